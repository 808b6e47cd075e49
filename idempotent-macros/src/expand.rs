//! Stage 3: writes the idempotent handler.
//!
//! The expansion keeps the user's signature minus the transaction
//! parameter, claims the key through the store, runs the original body in
//! an `async move` block (so `return` and `?` keep their meaning) with the
//! transaction bound to the parameter's name, then commits or rolls back.
//! A "fake return edge" typed with the declared return type keeps inference
//! and type errors on the user's code (the tracing-attributes technique).

use proc_macro2::{Delimiter, Group, Ident, Span, TokenStream, TokenTree};
use quote::{ToTokens, format_ident, quote, quote_spanned};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Block, FnArg, ItemFn, ReturnType};

use crate::args::{self, Args, Expression};
use crate::ctxt::Ctxt;
use crate::handler::{self, Handler};

/// The whole macro: parse, check, expand (or report).
pub fn idempotent(attr: TokenStream, item: TokenStream) -> TokenStream {
    let cx = Ctxt::new();
    let func: ItemFn = match syn::parse2(item.clone()) {
        Ok(func) => func,
        Err(_) => {
            cx.error_spanned_by(
                item_head(&item),
                "#[idempotent] applies to an `async fn` with a body (a free function or a method), not to this item",
            );
            let errors = cx.check().err().unwrap_or_default();
            return quote!(#errors #item);
        }
    };
    let args = args::parse(&cx, attr);
    let handler = handler::analyze(&cx, func, &args);
    match (cx.check(), &args.key, &args.store) {
        (Ok(()), Some(key), Some(store)) => expand(&handler, &args, key, store),
        // `args::parse` reports a missing `key` or `store`; never reached.
        (Ok(()), _, _) => {
            let error = syn::Error::new(Span::call_site(), "#[idempotent] needs `key = ..` and `store = ..`");
            fallback(handler, error.to_compile_error())
        }
        (Err(errors), _, _) => fallback(handler, errors),
    }
}

fn expand(handler: &Handler, args: &Args, key: &Expression, store: &syn::Expr) -> TokenStream {
    let krate = &args.krate;
    let rt = quote!(#krate::__private);
    let func = &handler.func;
    let sig = &func.sig;
    let (ttl, lease) = (args.ttl_ms, args.lease_ms);

    let mixed = Span::mixed_site();
    // These two are spanned on the user's `store` and `key` tokens: rustc
    // points at the argument that fails a bound, and these are the
    // arguments of the store and key checks. A key written as a string is
    // pointed at as written (the string), not at the tokens parsed from it.
    let key_written = key.written();
    let key_expr = &key.expr;
    let store_ref = format_ident!("__idem_store", span = ends(&store.to_token_stream()).1);
    let key_source = format_ident!("__idem_key_source", span = ends(&key_written).1);
    let store_arg = borrowed(&store_ref, store);
    let key_arg = borrowed(&key_source, &key_written);
    let key_text = format_ident!("__idem_key", span = mixed);
    let request = format_ident!("__idem_request", span = mixed);
    let span = format_ident!("__idem_span", span = mixed);
    let claim = format_ident!("__idem_claim", span = mixed);
    let guard = format_ident!("__idem_guard", span = mixed);
    let outcome = format_ident!("__idem_outcome", span = mixed);
    let fake = format_ident!("__idem_fake_return", span = mixed);
    let error = format_ident!("__idem_error", span = mixed);
    let replay = format_ident!("__idem_replay", span = mixed);
    let codec = format_ident!("__idem_codec", span = mixed);
    let into_error = format_ident!("__idem_into_error", span = mixed);
    let binder = format_ident!("__idem_binder", span = mixed);
    let finished = format_ident!("__idem_finished", span = mixed);
    let scope = format_ident!("__idem_scope", span = mixed);
    let logged_key = format_ident!("__idem_logged_key", span = mixed);
    let handler_path = format_ident!("__idem_handler", span = mixed);
    let site = format_ident!("__IDEM_SITE", span = mixed);
    let probe = format_ident!("__idem_probe", span = mixed);
    let instance = format_ident!("__idem_instance", span = mixed);
    let shared = args.shared_scope;
    let caller = quote! {
        #rt::Caller { site: &#site, path: #handler_path, scope: #scope, instance: #instance }
    };

    // The scope: the explicit one, or the handler's path (see the runtime's
    // `scope` module), read from the type name of a closure in this body.
    // The path is a function: with an explicit scope only the scope
    // registry asks for it, once per handler, not every call. A default
    // scope belongs to one instantiation of a generic handler (the type of
    // the closure `#probe` carries every generic parameter of the handler
    // and its impl, and so identifies the instantiation; the `static` site
    // is one for all of them); an explicit scope to all of them.
    let (instance_value, scope_value) = match &args.scope {
        Some(lit) => (quote!(#rt::Instance::ANY), quote!(#lit)),
        None => (
            quote!(#rt::Instance::of(&#probe)),
            quote!(#rt::default_scope(&#site, #instance, #handler_path)),
        ),
    };
    let probes = transaction_probes(handler, &rt);

    // Each requirement on a type is named once, on the user's tokens it is
    // about, so rustc reports it there (and only there) with the runtime
    // trait's `on_unimplemented` explanation.
    let return_type = match &sig.output {
        ReturnType::Type(_, ty) => ty.to_token_stream(),
        ReturnType::Default => quote!(()),
    };
    let ok_type = handler
        .ok_type
        .as_ref()
        .map_or_else(|| quote!(_), ToTokens::to_token_stream);
    let err_type = handler
        .err_type
        .as_ref()
        .map_or_else(|| quote!(_), ToTokens::to_token_stream);
    let ok_at = handler
        .ok_type
        .as_ref()
        .map_or_else(|| return_type.clone(), ToTokens::to_token_stream);
    let err_at = handler
        .err_type
        .as_ref()
        .map_or_else(|| return_type.clone(), ToTokens::to_token_stream);
    // `T` written `()` (the only spelling that is always the unit type):
    // duplicates replay `()` whatever is stored, so without a fingerprint
    // the store need not read the marker. An alias of `()` is not
    // recognised and keeps the read.
    let unit_result = handler.ok_type.as_ref().is_some_and(is_unit);
    let codec_of = qualified(&rt, &ok_type, "StoredResult", "codec", &ok_at);
    let from_store = qualified(&rt, &err_type, "HandlerError", "from_store", &err_at);
    let key_call = call(&rt, "key", quote!(#scope, #key_arg), &key_written);

    // The fingerprint is bound like the key, to a variable spanned on what
    // the user wrote: rustc points a failed bound at the innermost
    // expression it can, and the tokens parsed from a string are located
    // at the macro's call (the whole attribute) for that purpose.
    let (fingerprint_let, fingerprint) = match &args.fingerprint {
        Some(expression) => {
            let written = expression.written();
            let expr = &expression.expr;
            let source = format_ident!("__idem_fingerprint_source", span = ends(&written).1);
            let source_arg = borrowed(&source, &written);
            (
                Some(quote! {
                    #[allow(unused_parens, clippy::needless_borrow)]
                    let #source = &(#expr);
                }),
                call(&rt, "fingerprint", source_arg, &written),
            )
        }
        None => (None, quote!(::core::result::Result::Ok(::core::option::Option::None))),
    };
    let bail = quote! {
        ::core::result::Result::Err(#error) => return ::core::result::Result::Err(#into_error(#error)),
    };

    // The store is checked on the `store = ..` expression: `Store`, or
    // `TransactionalStore` when the handler takes a transaction parameter.
    // With an outbox, the store's one requirement is checked by `stager`
    // (so a store without an outbox is reported once), which also lends
    // the transaction.
    let stager = format_ident!("__idem_stager", span = mixed);
    // Likewise `binder` checks a transactional store; the claim itself only
    // needs a store.
    let claim_call = call(&rt, "claim", quote!(#store_arg, &#request, &#span, #caller), store);
    let (stager_let, stager_out) = match &handler.outbox {
        Some(_) => {
            let stager_call = call(&rt, "stager", store_arg.clone(), store);
            (Some(quote!(let #stager = #stager_call;)), quote!(#stager))
        }
        None => (None, quote!(())),
    };
    let (binder_let, binder_out) = match (&handler.tx, &handler.outbox) {
        (Some(_), Some(_)) => (Some(quote!(let #binder = #stager.binder();)), quote!(#binder)),
        (Some(_), None) => {
            let binder_call = call(&rt, "binder", store_arg.clone(), store);
            (Some(quote!(let #binder = #binder_call;)), quote!(#binder))
        }
        (None, _) => (None, quote!(())),
    };
    let claim_await = awaited(claim_call, store);
    let bind_tx = handler.tx.as_ref().map(|tx| {
        let pat = &tx.pat;
        let ty = &tx.ty;
        let bind_call = call(&rt, "bind_transaction", quote!(#binder, &mut #guard), ty);
        quote!(let #pat: #ty = #bind_call;)
    });
    let outbox = format_ident!("__idem_outbox", span = mixed);
    let bind_outbox = handler.outbox.as_ref().map(|param| {
        let pat = &param.pat;
        let ty = &param.ty;
        let bind_call = call(&rt, "bind_outbox", quote!(&mut #outbox), ty);
        quote!(let #pat: #ty = #bind_call;)
    });
    let (new_outbox, finish_call) = match &handler.outbox {
        Some(_) => (
            Some(quote!(let mut #outbox = #rt::Outbox::new();)),
            quote!(#rt::finish_staged(#stager, #guard, #outbox, #codec, #outcome, #span, #scope, &#logged_key)),
        ),
        None => (
            None,
            quote!(#rt::finish(#guard, #codec, #outcome, #span, #scope, &#logged_key)),
        ),
    };
    let guard_binding = if handler.tx.is_some() || handler.outbox.is_some() {
        quote!(mut #guard)
    } else {
        quote!(#guard)
    };

    let stmts = &func.block.stmts;
    let body = quote_spanned! {func.block.span()=>
        async move {
            #[allow(
                unknown_lints,
                unreachable_code,
                clippy::diverging_sub_expression,
                clippy::empty_loop,
                clippy::let_unit_value,
                clippy::needless_return,
                clippy::unreachable
            )]
            if false {
                let #fake: #return_type = loop {};
                return #fake;
            }
            #(#stmts)*
        }
    };

    let new_block: Block = syn::parse_quote! {{
        #probes
        let #codec = #codec_of();
        let #into_error = #from_store;
        static #site: #rt::Site = #rt::Site::new(::core::file!(), ::core::line!(), #shared);
        let #probe = || #rt::handler_path(::core::any::type_name_of_val(&|| ()));
        let #instance: #rt::Instance = #instance_value;
        let #handler_path: fn() -> &'static str = #probe;
        let #scope: &'static str = #scope_value;
        let (#claim, #span, #binder, #stager, #logged_key) = {
            #[allow(unused_parens, clippy::needless_borrow)]
            let #store_ref = &(#store);
            #stager_let
            #binder_let
            #[allow(unused_parens, clippy::needless_borrow)]
            let #key_source = &(#key_expr);
            let #key_text = match #key_call {
                ::core::result::Result::Ok(key) => key,
                #bail
            };
            #fingerprint_let
            let #request = match #rt::request(#scope, &#key_text, #ttl, #lease, #fingerprint, #unit_result) {
                ::core::result::Result::Ok(request) => request,
                #bail
            };
            let #span = #rt::span(&#request);
            let #claim = #claim_await;
            let #logged_key = #rt::logged_key(&#claim, &#key_text);
            (#claim, #span, #binder_out, #stager_out, #logged_key)
        };
        match #claim {
            ::core::result::Result::Err(#error) => ::core::result::Result::Err(#into_error(#error)),
            ::core::result::Result::Ok(#rt::Claim::Done(#replay)) => match #codec.replay(&#replay) {
                ::core::result::Result::Ok(value) => ::core::result::Result::Ok(value),
                #bail
            },
            ::core::result::Result::Ok(#rt::Claim::Fresh(#guard_binding)) => {
                #new_outbox
                let #outcome = {
                    #bind_tx
                    #bind_outbox
                    #rt::Instrument::instrument(#body, ::core::clone::Clone::clone(&#span)).await
                };
                match #finish_call.await {
                    ::core::result::Result::Ok(#finished) => #finished,
                    #bail
                }
            }
        }
    }};

    let mut out = func.clone();
    out.sig.inputs = without_tx(handler);
    *out.block = new_block;
    quote!(#out)
}

/// `()`, possibly parenthesised.
fn is_unit(ty: &syn::Type) -> bool {
    match ty {
        syn::Type::Tuple(tuple) => tuple.elems.is_empty(),
        syn::Type::Paren(inner) => is_unit(&inner.elem),
        syn::Type::Group(inner) => is_unit(&inner.elem),
        _ => false,
    }
}

/// For every parameter that could be a database transaction or connection
/// behind an alias, re-export or qualified path: a check, at type level and
/// spanned on the parameter, that it is not one (or the body would run in the
/// caller's transaction instead of the marker's). The diagnostics are local
/// traits, so their messages can name the parameter.
fn transaction_probes(handler: &Handler, rt: &TokenStream) -> TokenStream {
    handler
        .probes
        .iter()
        .enumerate()
        .map(|(index, probe)| {
            let (first, _) = ends(&probe.span_of);
            // Spanned on the parameter: the unsatisfied bound is reported on
            // this argument of the check.
            let kind = format_ident!("__idem_param_kind_{}", index, span = first);
            let name = probe
                .name
                .as_ref()
                .map_or_else(|| "this parameter".to_owned(), |name| format!("`{name}`"));
            let tx_arg = probe
                .name
                .as_ref()
                .map_or_else(|| "a name to this parameter and `tx = <its name>`".to_owned(), |name| format!("`tx = {name}`"));
            let tx_message = format!(
                "the parameter {name} is a database transaction or connection that #[idempotent] does not recognise (a type alias, a re-export or a qualified path)"
            );
            let tx_label = format!("add {tx_arg} to #[idempotent(..)] to run the body in the marker's transaction");
            let tx_note = format!(
                "as written, {name} stays a parameter and the caller passes a transaction of its own: the effect would not be atomic with the marker"
            );
            let outbox_arg = probe
                .name
                .as_ref()
                .map_or_else(|| "a name to this parameter and `outbox = <its name>`".to_owned(), |name| format!("`outbox = {name}`"));
            let outbox_message = format!(
                "the parameter {name} is an outbox that #[idempotent] does not recognise (a type alias, a re-export or a qualified path)"
            );
            let outbox_label = format!("add {outbox_arg} to #[idempotent(..)] to write its messages in the marker's transaction");
            let outbox_note = format!(
                "as written, {name} stays a parameter and the caller passes an outbox of its own: the messages staged on it would never be sent"
            );
            let pool_message =
                format!("the parameter {name} is a pooled connection: the handler's body would write outside the marker's transaction");
            let ty = &probe.ty;
            let path = respan(rt, first);
            let check = Ident::new("__idem_not_a_transaction", first);
            let mut args = Group::new(Delimiter::Parenthesis, quote!(#kind));
            args.set_span(first);
            quote_spanned! {first=>
                #[allow(unused_imports)]
                let #kind = {
                    use #path::ProbeFallback as _;
                    #path::TxProbe::<#ty>::new().kind()
                };
                {
                    #[diagnostic::on_unimplemented(message = #tx_message, label = #tx_label, note = #tx_note)]
                    trait NotATransactionParameter {}
                    #[diagnostic::do_not_recommend]
                    impl NotATransactionParameter for #path::NotATransaction {}
                    #[diagnostic::do_not_recommend]
                    impl NotATransactionParameter for #path::APooledConnection {}
                    #[diagnostic::do_not_recommend]
                    impl NotATransactionParameter for #path::AnOutbox {}
                    #[diagnostic::on_unimplemented(
                        message = #pool_message,
                        label = "take `&mut` the database's connection type instead (`&mut PgConnection`, ...): #[idempotent] binds it to the marker's transaction",
                        note = "to write outside the marker's transaction on purpose (a store that cannot join it), take the pool instead"
                    )]
                    trait NotAPooledConnectionParameter {}
                    #[diagnostic::do_not_recommend]
                    impl NotAPooledConnectionParameter for #path::NotATransaction {}
                    #[diagnostic::do_not_recommend]
                    impl NotAPooledConnectionParameter for #path::ATransaction {}
                    #[diagnostic::do_not_recommend]
                    impl NotAPooledConnectionParameter for #path::AnOutbox {}
                    #[diagnostic::on_unimplemented(message = #outbox_message, label = #outbox_label, note = #outbox_note)]
                    trait NotAnOutboxParameter {}
                    #[diagnostic::do_not_recommend]
                    impl NotAnOutboxParameter for #path::NotATransaction {}
                    #[diagnostic::do_not_recommend]
                    impl NotAnOutboxParameter for #path::ATransaction {}
                    #[diagnostic::do_not_recommend]
                    impl NotAnOutboxParameter for #path::APooledConnection {}
                    #[inline(always)]
                    fn #check<K: NotATransactionParameter + NotAPooledConnectionParameter + NotAnOutboxParameter>(_: K) {}
                    #check #args;
                }
            }
        })
        .collect()
}

/// The first and last spans of `tokens`: rustc reports an expression whose
/// first token has the first span and whose last token has the last span
/// on the whole range (without `Span::join`, which is unstable).
fn ends(tokens: &TokenStream) -> (Span, Span) {
    let mut iter = tokens.clone().into_iter();
    let first = iter.next().map_or_else(Span::call_site, |token| token.span());
    let last = iter.last().map_or(first, |token| token.span());
    (first, last)
}

/// `tokens` with every span set to `span`.
pub(crate) fn respan(tokens: &TokenStream, span: Span) -> TokenStream {
    tokens
        .clone()
        .into_iter()
        .map(|mut token| {
            if let TokenTree::Group(group) = &token {
                let mut inner = Group::new(group.delimiter(), respan(&group.stream(), span));
                inner.set_span(span);
                token = TokenTree::Group(inner);
            } else {
                token.set_span(span);
            }
            token
        })
        .collect()
}

/// `#rt::name(args)`, spanned on the tokens of `at`: a bound of `name` that
/// fails is reported on them.
fn call(rt: &TokenStream, name: &str, args: TokenStream, at: &dyn ToTokens) -> TokenStream {
    let (first, last) = ends(&at.to_token_stream());
    let path = respan(rt, first);
    let name = Ident::new(name, last);
    let mut args = Group::new(Delimiter::Parenthesis, args);
    args.set_span(last);
    quote_spanned!(first=> #path :: #name #args)
}

/// `<#ty as #rt::Trait>::item`, spanned on the tokens of `at`.
fn qualified(rt: &TokenStream, ty: &TokenStream, trait_name: &str, item: &str, at: &TokenStream) -> TokenStream {
    let (first, last) = ends(at);
    let path = respan(rt, first);
    let trait_name = Ident::new(trait_name, first);
    let item = Ident::new(item, last);
    quote_spanned!(first=> <#ty as #path :: #trait_name>:: #item)
}

/// `&*#binding`, spanned from the first to the last token of `at`.
fn borrowed(binding: &Ident, at: &dyn ToTokens) -> TokenStream {
    let (first, _) = ends(&at.to_token_stream());
    quote_spanned!(first=> &*#binding)
}

/// `#future.await`, spanned on the tokens of `at`.
fn awaited(future: TokenStream, at: &dyn ToTokens) -> TokenStream {
    let (_, last) = ends(&at.to_token_stream());
    quote_spanned!(last=> #future.await)
}

/// The signature's parameters without the transaction and outbox
/// parameters.
fn without_tx(handler: &Handler) -> Punctuated<FnArg, syn::Token![,]> {
    handler
        .func
        .sig
        .inputs
        .iter()
        .enumerate()
        .filter(|(index, _)| {
            [&handler.tx, &handler.outbox]
                .into_iter()
                .flatten()
                .all(|param| param.index != *index)
        })
        .map(|(_, arg)| arg.clone())
        .collect()
}

/// After errors: the errors, and a stand-in function with the signature the
/// expansion would have had, so callers do not cascade into more errors.
fn fallback(handler: Handler, errors: TokenStream) -> TokenStream {
    let mut stub = handler.func.clone();
    stub.sig.inputs = without_tx(&handler);
    stub.sig.asyncness = Some(Default::default());
    // The transaction parameter's type stays named, so its imports are not
    // reported unused on top of the real errors.
    let tx_type = [&handler.tx, &handler.outbox].into_iter().flatten().map(|param| {
        let ty = &param.ty;
        quote!(let _: ::core::option::Option<#ty> = ::core::option::Option::None;)
    });
    *stub.block = syn::parse_quote!({
        #(#tx_type)*
        ::core::unreachable!()
    });
    stub.attrs
        .push(syn::parse_quote!(#[allow(unused_variables, clippy::unused_async)]));
    quote!(#errors #stub)
}

/// Where to point "not a function": the item's keyword and name (after its
/// attributes and visibility).
fn item_head(item: &TokenStream) -> TokenStream {
    let mut tokens = item.clone().into_iter().peekable();
    let mut head = TokenStream::new();
    while let Some(token) = tokens.next() {
        match &token {
            // Outer attributes: `#` and its bracket group.
            TokenTree::Punct(p) if p.as_char() == '#' => {
                tokens.next_if(|t| matches!(t, TokenTree::Group(g) if g.delimiter() == Delimiter::Bracket));
            }
            // Visibility: `pub` and its optional `(crate)`.
            TokenTree::Ident(i) if i == "pub" => {
                tokens.next_if(|t| matches!(t, TokenTree::Group(g) if g.delimiter() == Delimiter::Parenthesis));
            }
            _ => {
                head.extend([token]);
                head.extend(tokens.next());
                break;
            }
        }
    }
    head
}
