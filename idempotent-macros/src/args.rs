//! Stage 1: the attribute's arguments, `key = .., store = .., ...`.

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use syn::ext::IdentExt;
use syn::parse::{ParseStream, Parser};
use syn::{Expr, ExprLit, Ident, Lit, LitStr, Token};

use crate::ctxt::Ctxt;
use crate::duration::parse_millis;
use crate::expand::respan;
use crate::suggest::closest;

const NAMES: &[&str] = &[
    "key",
    "store",
    "scope",
    "shared_scope",
    "ttl",
    "fingerprint",
    "lease",
    "tx",
    "outbox",
    "crate",
];

/// The default marker lifetime: seven days.
const DEFAULT_TTL_MS: u64 = 7 * 86_400_000;
/// The default lease of stores that cannot join a transaction.
const DEFAULT_LEASE_MS: u64 = 30_000;

/// The parsed attribute.
pub struct Args {
    /// `key = ..`: the expression identifying a message.
    pub key: Option<Expression>,
    /// `store = ..`: the expression giving the store.
    pub store: Option<Expr>,
    /// `scope = ".."`: namespace of the markers.
    pub scope: Option<LitStr>,
    /// `shared_scope = true`: another handler may use the same explicit scope.
    pub shared_scope: bool,
    /// `ttl = ".."` in milliseconds.
    pub ttl_ms: u64,
    /// `lease = ".."` in milliseconds.
    pub lease_ms: u64,
    /// `fingerprint = ..`.
    pub fingerprint: Option<Expression>,
    /// `tx = ..`: the name of the transaction parameter.
    pub tx: Option<Ident>,
    /// `outbox = ..`: the name of the outbox parameter.
    pub outbox: Option<Ident>,
    /// `crate = ".."`: path to the runtime.
    pub krate: syn::Path,
}

/// A `key` or `fingerprint`: the expression the expansion evaluates and
/// where the user wrote it.
pub struct Expression {
    /// The expression, parsed from the string when it is one.
    pub expr: Expr,
    /// The string literal it was written as (`key = "msg.message_id"`), or
    /// `None` for a bare expression (`key = msg.message_id`).
    pub string: Option<LitStr>,
}

impl Expression {
    /// The tokens the user wrote: where an error about the whole
    /// expression points (the string, or the bare expression).
    pub fn written(&self) -> TokenStream {
        match &self.string {
            Some(lit) => lit.to_token_stream(),
            None => self.expr.to_token_stream(),
        }
    }
}

/// Parses the attribute, recording every problem in `cx`.
pub fn parse(cx: &Ctxt, tokens: TokenStream) -> Args {
    let mut args = Args {
        key: None,
        store: None,
        scope: None,
        shared_scope: false,
        ttl_ms: DEFAULT_TTL_MS,
        lease_ms: DEFAULT_LEASE_MS,
        fingerprint: None,
        tx: None,
        outbox: None,
        krate: syn::parse_quote!(::idempotent_runtime),
    };
    let mut seen: Vec<String> = Vec::new();
    // Where `shared_scope = true` was written, to point at it.
    let mut shared_at: Option<Ident> = None;
    // Names that a misspelled argument was taken for: not reported missing too.
    let mut suggested: Vec<&str> = Vec::new();
    let whole = tokens.clone();
    let parser = |input: ParseStream| -> syn::Result<()> {
        while !input.is_empty() {
            let name = Ident::parse_any(input)?;
            input.parse::<Token![=]>()?;
            let value: Expr = input.parse()?;
            let text = name.to_string();
            if seen.contains(&text) {
                cx.error_spanned_by(&name, format!("expected only a single `{text}` argument"));
            } else {
                if !NAMES.contains(&text.as_str()) {
                    suggested.extend(closest(&text, NAMES));
                }
                seen.push(text.clone());
                apply(cx, &mut args, &name, value);
                if text == "shared_scope" && args.shared_scope {
                    shared_at = Some(name.clone());
                }
            }
            if input.is_empty() {
                break;
            }
            input.parse::<Token![,]>()?;
        }
        Ok(())
    };
    if let Err(error) = parser.parse2(tokens) {
        cx.syn_error(error);
        return args;
    }
    if let (Some(shared), None) = (&shared_at, &args.scope) {
        cx.error_spanned_by(
            shared,
            "`shared_scope` needs an explicit `scope = \"..\"` on every handler that shares it: a default scope belongs to one handler",
        );
    }
    for (required, example, meaning) in [
        (
            "key",
            "key = \"msg.message_id\"",
            "an expression over the handler's parameters that identifies the message",
        ),
        (
            "store",
            "store = self.store",
            "an expression giving the store that keeps the processed markers",
        ),
    ] {
        if !seen.iter().any(|s| s == required) && !suggested.contains(&required) {
            let message = format!("missing `{required}` argument: add `{example}`, {meaning}");
            if whole.is_empty() {
                cx.error_at(Span::call_site(), message);
            } else {
                cx.error_spanned_by(&whole, message);
            }
        }
    }
    args
}

fn apply(cx: &Ctxt, args: &mut Args, name: &Ident, value: Expr) {
    match name.to_string().as_str() {
        "key" => args.key = expression(cx, "key", value),
        "store" => args.store = Some(value),
        "fingerprint" => args.fingerprint = expression(cx, "fingerprint", value),
        "scope" => {
            if let Some(scope) = string(cx, "scope", &value, "scope = \"payments\"") {
                let text = scope.value();
                if text.is_empty() || text.len() > 128 || text.contains('\0') {
                    cx.error_spanned_by(&scope, "`scope` must be 1 to 128 bytes long, without NUL");
                } else {
                    args.scope = Some(scope);
                }
            }
        }
        "shared_scope" => match &value {
            Expr::Lit(ExprLit {
                lit: Lit::Bool(flag), ..
            }) => args.shared_scope = flag.value,
            other => cx.error_spanned_by(other, "`shared_scope` takes `true` or `false`"),
        },
        "ttl" => {
            if let Some(ms) = duration(cx, "ttl", &value) {
                args.ttl_ms = ms;
            }
        }
        "lease" => {
            if let Some(ms) = duration(cx, "lease", &value) {
                args.lease_ms = ms;
            }
        }
        "tx" => args.tx = parameter_name(cx, "tx", &value, "conn"),
        "outbox" => args.outbox = parameter_name(cx, "outbox", &value, "events"),
        "crate" => {
            if let Some(lit) = string(cx, "crate", &value, "crate = \"my_reexport::idempotent_runtime\"") {
                match lit.parse::<syn::Path>() {
                    Ok(path) => args.krate = path,
                    Err(_) => {
                        cx.error_spanned_by(&lit, "`crate` must be a path, like `crate = \"::idempotent_runtime\"`")
                    }
                }
            }
        }
        unknown => {
            let message = match closest(unknown, NAMES) {
                Some(intended) => {
                    format!("unknown argument `{unknown}`; did you mean `{intended}`?")
                }
                None => format!(
                    "unknown argument `{unknown}`; expected one of `key`, `store`, `scope`, `shared_scope`, `ttl`, `fingerprint`, `lease`, `tx`, `outbox`, `crate`"
                ),
            };
            cx.error_spanned_by(name, message);
        }
    }
}

/// `tx = conn` or `tx = "conn"`: the name of a parameter.
fn parameter_name(cx: &Ctxt, what: &str, value: &Expr, example: &str) -> Option<Ident> {
    if let Expr::Path(path) = value
        && let Some(ident) = path.path.get_ident()
    {
        return Some(ident.clone());
    }
    let lit = string(cx, what, value, &format!("{what} = \"{example}\""))?;
    match lit.parse::<Ident>() {
        Ok(ident) => Some(ident),
        Err(_) => {
            cx.error_spanned_by(
                &lit,
                format!("`{what}` names a parameter, like `{what} = \"{example}\"`"),
            );
            None
        }
    }
}

/// A key or fingerprint: a string holding an expression, or a bare expression.
///
/// The tokens parsed from a string are all located at the string, so
/// rustc reports a mistake in them (`"msg.mesage_id"`) on the whole string,
/// and a suggestion of rustc replaces the span of the token it fixes, which
/// is the whole string: `key = message_id`, which does not compile. The
/// tokens get the call site's hygiene (the same name resolution as the
/// user's code) located at the string: rustc then takes them for tokens the
/// macro wrote and offers no suggestion on them, while its errors still
/// point at the string. A bare expression keeps the user's spans, and
/// rustc's suggestions on it are right.
fn expression(cx: &Ctxt, what: &str, value: Expr) -> Option<Expression> {
    let Expr::Lit(ExprLit { lit: Lit::Str(lit), .. }) = &value else {
        return Some(Expression {
            expr: value,
            string: None,
        });
    };
    let located = Span::call_site().located_at(lit.span());
    match lit
        .parse::<TokenStream>()
        .and_then(|tokens| syn::parse2::<Expr>(respan(&tokens, located)))
    {
        Ok(expr) => Some(Expression {
            expr,
            string: Some(lit.clone()),
        }),
        Err(error) => {
            cx.error_spanned_by(
                lit,
                format!(
                    "`{what}` must be an expression over the handler's parameters, like \"msg.message_id\": {error}"
                ),
            );
            None
        }
    }
}

fn string(cx: &Ctxt, what: &str, value: &Expr, example: &str) -> Option<LitStr> {
    match value {
        Expr::Lit(ExprLit { lit: Lit::Str(lit), .. }) => Some(lit.clone()),
        other => {
            cx.error_spanned_by(other, format!("`{what}` takes a string literal, like `{example}`"));
            None
        }
    }
}

fn duration(cx: &Ctxt, what: &str, value: &Expr) -> Option<u64> {
    let lit = string(cx, what, value, &format!("{what} = \"30s\""))?;
    match parse_millis(&lit.value()) {
        Ok(ms) => Some(ms),
        Err(reason) => {
            cx.error_spanned_by(&lit, format!("invalid `{what}`: {reason}"));
            None
        }
    }
}
