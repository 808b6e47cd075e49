//! Stage 2: the handler's signature as a typed model (parameters, the
//! transaction parameter, the `Result` it returns), checked against the
//! rules of `#[idempotent]`.

use proc_macro2::TokenStream;
use quote::ToTokens;
use syn::visit::Visit;
use syn::{Expr, FnArg, GenericArgument, Ident, ItemFn, Pat, PathArguments, ReturnType, Type};

use crate::args::{Args, Expression};
use crate::ctxt::Ctxt;

/// The function under the attribute, understood.
pub struct Handler {
    pub func: ItemFn,
    /// The transaction parameter, removed from the generated signature.
    pub tx: Option<TxParam>,
    /// The outbox parameter, removed from the generated signature.
    pub outbox: Option<TxParam>,
    /// `T` of `Result<T, E>`, when written out.
    pub ok_type: Option<Type>,
    /// `E` of `Result<T, E>`, when written out (not for `io::Result<T>`-like aliases).
    pub err_type: Option<Type>,
    /// The other parameters whose type the expansion checks is not a
    /// transaction or connection the syntax did not reveal (an alias, a
    /// re-export, a qualified path).
    pub probes: Vec<ParamProbe>,
}

/// A parameter to check at type level: it must not be a database
/// transaction or connection, or the body would run outside the marker's
/// transaction.
pub struct ParamProbe {
    /// The parameter's name, when it is a plain binding.
    pub name: Option<Ident>,
    /// The parameter's type without its references.
    pub ty: Type,
    /// The whole parameter, where the error points.
    pub span_of: TokenStream,
}

/// A parameter the expansion binds (to the store's transaction, or to the
/// call's outbox).
pub struct TxParam {
    pub index: usize,
    pub pat: Pat,
    pub ty: Type,
}

/// Builds the model, recording every rule the signature breaks.
pub fn analyze(cx: &Ctxt, func: ItemFn, args: &Args) -> Handler {
    let sig = &func.sig;
    if sig.asyncness.is_none() {
        cx.error_spanned_by(
            sig.fn_token,
            "#[idempotent] handlers must be `async fn`: add `async` before `fn`",
        );
    }
    if let Some(variadic) = &sig.variadic {
        cx.error_spanned_by(variadic, "#[idempotent] handlers cannot be variadic");
    }

    let (ok_type, err_type) = result_types(cx, &func);

    // Parameters: their bound names, and the transaction parameter.
    let mut names: Vec<Ident> = Vec::new();
    let mut tx: Option<TxParam> = None;
    let mut outbox: Option<TxParam> = None;
    let mut probes: Vec<ParamProbe> = Vec::new();
    for (index, input) in sig.inputs.iter().enumerate() {
        let typed = match input {
            FnArg::Receiver(receiver) => {
                names.push(Ident::new("self", receiver.self_token.span));
                continue;
            }
            FnArg::Typed(typed) => typed,
        };
        let named_outbox = args
            .outbox
            .as_ref()
            .is_some_and(|name| matches!(&*typed.pat, Pat::Ident(p) if p.ident == *name));
        let looks_outbox = args.outbox.is_none() && is_outbox_type(&typed.ty);
        if named_outbox || looks_outbox {
            if let Type::Reference(reference) = plain(&typed.ty)
                && reference.mutability.is_none()
            {
                cx.error_spanned_by(
                    &typed.ty,
                    "the outbox parameter must be `&mut Outbox`: the handler stages its messages on it",
                );
            }
            match &outbox {
                Some(first) => cx.error_spanned_by(
                    typed,
                    format!(
                        "a handler takes at most one outbox parameter; `{}` is already bound to the call's outbox",
                        pat_text(&first.pat)
                    ),
                ),
                None => {
                    outbox = Some(TxParam {
                        index,
                        pat: (*typed.pat).clone(),
                        ty: (*typed.ty).clone(),
                    })
                }
            }
            continue;
        }
        let named_tx = args
            .tx
            .as_ref()
            .is_some_and(|tx| matches!(&*typed.pat, Pat::Ident(p) if p.ident == *tx));
        let looks_tx = args.tx.is_none() && is_transaction_type(&typed.ty);
        if named_tx || looks_tx {
            // An alias (`type Db<'a> = &'a mut PgConnection`) is checked by
            // the type system; a shared reference cannot be right.
            if let Type::Reference(reference) = plain(&typed.ty)
                && reference.mutability.is_none()
            {
                cx.error_spanned_by(
                    &typed.ty,
                    "the transaction parameter must be a `&mut` reference to a transaction or connection",
                );
            }
            match &tx {
                Some(first) => cx.error_spanned_by(
                    typed,
                    format!(
                        "a handler takes at most one transaction parameter; `{}` is already bound to the store's transaction",
                        pat_text(&first.pat)
                    ),
                ),
                None => tx = Some(TxParam { index, pat: (*typed.pat).clone(), ty: (*typed.ty).clone() }),
            }
            continue;
        }
        if let Some(ty) = probed_type(&typed.ty) {
            probes.push(ParamProbe {
                name: match &*typed.pat {
                    Pat::Ident(p) => Some(p.ident.clone()),
                    _ => None,
                },
                ty,
                span_of: typed.to_token_stream(),
            });
        }
        collect_bindings(&typed.pat, &mut names);
    }
    if let (Some(wanted), None) = (&args.tx, &tx) {
        cx.error_spanned_by(
            wanted,
            format!(
                "`tx = {wanted}` names no parameter of `{}`; parameters: {}",
                sig.ident,
                list(&names)
            ),
        );
    }

    if let (Some(wanted), None) = (&args.outbox, &outbox) {
        cx.error_spanned_by(
            wanted,
            format!(
                "`outbox = {wanted}` names no parameter of `{}`; parameters: {}",
                sig.ident,
                list(&names)
            ),
        );
    }

    // Bound by the expansion after the key is read.
    let bound: Vec<(Ident, &str)> = [(&tx, "transaction"), (&outbox, "outbox")]
        .into_iter()
        .filter_map(|(param, kind)| match &param.as_ref()?.pat {
            Pat::Ident(p) => Some((p.ident.clone(), kind)),
            _ => None,
        })
        .collect();
    if let Some(key) = &args.key {
        check_over_parameters(cx, "key", key, &names, &bound, &sig.ident);
    }
    if let Some(fingerprint) = &args.fingerprint {
        check_over_parameters(cx, "fingerprint", fingerprint, &names, &bound, &sig.ident);
    }

    Handler {
        func,
        tx,
        outbox,
        ok_type,
        err_type,
        probes,
    }
}

/// `ty` without the invisible groups a `macro_rules!` fragment (`$t:ty`)
/// wraps it in, nor parentheses: what the type says, however it was
/// written.
fn plain(mut ty: &Type) -> &Type {
    loop {
        match ty {
            Type::Group(group) => ty = &group.elem,
            Type::Paren(paren) => ty = &paren.elem,
            _ => return ty,
        }
    }
}

/// The type to probe for a parameter of type `ty`: `ty` without its
/// references, or `None` when it cannot be named in an expression
/// (`impl Trait`, `_`) or plainly is not a transaction (a primitive, a
/// slice, a tuple...).
fn probed_type(ty: &Type) -> Option<Type> {
    let mut ty = plain(ty);
    while let Type::Reference(reference) = ty {
        ty = plain(&reference.elem);
    }
    if !matches!(ty, Type::Path(_)) {
        return None;
    }
    struct Unnameable(bool);
    impl<'ast> Visit<'ast> for Unnameable {
        fn visit_type_impl_trait(&mut self, _: &'ast syn::TypeImplTrait) {
            self.0 = true;
        }
        fn visit_type_infer(&mut self, _: &'ast syn::TypeInfer) {
            self.0 = true;
        }
        fn visit_type_macro(&mut self, _: &'ast syn::TypeMacro) {
            self.0 = true;
        }
    }
    let mut unnameable = Unnameable(false);
    unnameable.visit_type(ty);
    (!unnameable.0).then(|| ty.clone())
}

/// `&mut X` where `X` is `Transaction<..>` or a known sqlx connection type.
fn is_transaction_type(ty: &Type) -> bool {
    let Type::Reference(reference) = plain(ty) else {
        return false;
    };
    if reference.mutability.is_none() {
        return false;
    }
    let Type::Path(path) = plain(&reference.elem) else {
        return false;
    };
    path.path.segments.last().is_some_and(|last| {
        matches!(
            last.ident.to_string().as_str(),
            "Transaction" | "PgConnection" | "SqliteConnection" | "MySqlConnection"
        )
    })
}

/// `&mut Outbox` (any path ending in `Outbox`).
fn is_outbox_type(ty: &Type) -> bool {
    let Type::Reference(reference) = plain(ty) else {
        return false;
    };
    let Type::Path(path) = plain(&reference.elem) else {
        return false;
    };
    reference.mutability.is_some() && path.path.segments.last().is_some_and(|last| last.ident == "Outbox")
}

/// `T` and `E` of the declared `Result<T, E>` (or `Result<T>` alias).
fn result_types(cx: &Ctxt, func: &ItemFn) -> (Option<Type>, Option<Type>) {
    let explain = "#[idempotent] handlers must return `Result<T, E>` with `E: From<idempotent_runtime::Error>`: the store can fail, and duplicates answer with the stored `T`";
    let ty = match &func.sig.output {
        ReturnType::Default => {
            cx.error_spanned_by(&func.sig.ident, format!("`{}` returns `()`; {explain}", func.sig.ident));
            return (None, None);
        }
        ReturnType::Type(_, ty) => ty,
    };
    let last = match &**ty {
        Type::Path(path) if path.qself.is_none() => path.path.segments.last(),
        _ => None,
    };
    let Some(last) = last.filter(|last| last.ident == "Result") else {
        cx.error_spanned_by(ty, explain);
        return (None, None);
    };
    let PathArguments::AngleBracketed(generics) = &last.arguments else {
        cx.error_spanned_by(ty, explain);
        return (None, None);
    };
    let mut types = generics.args.iter().filter_map(|arg| match arg {
        GenericArgument::Type(ty) => Some(ty.clone()),
        _ => None,
    });
    (types.next(), types.next())
}

fn collect_bindings(pat: &Pat, names: &mut Vec<Ident>) {
    struct Bindings<'a>(&'a mut Vec<Ident>);
    impl<'ast> Visit<'ast> for Bindings<'_> {
        fn visit_pat_ident(&mut self, pat: &'ast syn::PatIdent) {
            self.0.push(pat.ident.clone());
            syn::visit::visit_pat_ident(self, pat);
        }
    }
    Bindings(names).visit_pat(pat);
}

/// Every variable a key or fingerprint expression reads must be a parameter
/// (other than the transaction).
fn check_over_parameters(
    cx: &Ctxt,
    what: &str,
    expression: &Expression,
    params: &[Ident],
    bound: &[(Ident, &str)],
    func: &Ident,
) {
    let mut finder = Variables {
        found: Vec::new(),
        locals: Vec::new(),
        opaque: false,
    };
    finder.visit_expr(&expression.expr);
    for variable in &finder.found {
        // A variable of a string points at the string (where its tokens
        // are located anyway), a variable of a bare expression at itself.
        let at = match &expression.string {
            Some(lit) => lit.to_token_stream(),
            None => variable.to_token_stream(),
        };
        if let Some((_, kind)) = bound.iter().find(|(name, _)| name == variable) {
            cx.error_spanned_by(
                &at,
                format!("the {what} cannot use the {kind} parameter `{variable}`: it is bound after the key is read"),
            );
        } else if !params.contains(variable) {
            cx.error_spanned_by(
                &at,
                format!(
                    "the {what} must be computed from the parameters of `{func}`, but `{variable}` is not one of them; parameters: {}",
                    list(params)
                ),
            );
        }
    }
    if finder.found.is_empty() && !finder.opaque {
        cx.error_spanned_by(
            expression.written(),
            format!(
                "the {what} must be computed from the parameters of `{func}` (a constant {what} would make every message a duplicate); parameters: {}",
                list(params)
            ),
        );
    }
}

/// Finds the local variables an expression reads.
struct Variables {
    found: Vec<Ident>,
    locals: Vec<Ident>,
    /// Contains a macro call, whose tokens cannot be inspected.
    opaque: bool,
}

impl<'ast> Visit<'ast> for Variables {
    fn visit_expr_path(&mut self, path: &'ast syn::ExprPath) {
        if path.qself.is_some() || path.path.leading_colon.is_some() || path.path.segments.len() != 1 {
            return;
        }
        let ident = &path.path.segments[0].ident;
        let is_constant = ident.to_string().starts_with(|c: char| c.is_ascii_uppercase());
        if !is_constant && !self.locals.contains(ident) {
            self.found.push(ident.clone());
        }
    }

    fn visit_expr_call(&mut self, call: &'ast syn::ExprCall) {
        // `f(x)`: `f` names a function, not a variable.
        if !matches!(&*call.func, Expr::Path(_)) {
            self.visit_expr(&call.func);
        }
        for arg in &call.args {
            self.visit_expr(arg);
        }
    }

    fn visit_expr_closure(&mut self, closure: &'ast syn::ExprClosure) {
        for input in &closure.inputs {
            collect_bindings(input, &mut self.locals);
        }
        self.visit_expr(&closure.body);
    }

    fn visit_macro(&mut self, _: &'ast syn::Macro) {
        self.opaque = true;
    }
}

fn pat_text(pat: &Pat) -> String {
    match pat {
        Pat::Ident(p) => p.ident.to_string(),
        other => quote::quote!(#other).to_string(),
    }
}

fn list(names: &[Ident]) -> String {
    if names.is_empty() {
        return "none".to_owned();
    }
    names.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
}
