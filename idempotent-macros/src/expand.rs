//! Stage 3: writes the idempotent handler.
//!
//! The expansion keeps the user's signature minus the transaction
//! parameter, claims the key through the store, runs the original body in
//! an `async move` block (so `return` and `?` keep their meaning) with the
//! transaction bound to the parameter's name, then commits or rolls back.
//! A "fake return edge" typed with the declared return type keeps inference
//! and type errors on the user's code (the tracing-attributes technique).

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::punctuated::Punctuated;
use syn::spanned::Spanned;
use syn::{Block, FnArg, ItemFn, LitStr, ReturnType};

use crate::args::{self, Args};
use crate::ctxt::Ctxt;
use crate::handler::{self, Handler};

/// The whole macro: parse, check, expand (or report).
pub fn idempotent(attr: TokenStream, item: TokenStream) -> TokenStream {
    let cx = Ctxt::new();
    let func: ItemFn = match syn::parse2(item.clone()) {
        Ok(func) => func,
        Err(_) => {
            cx.error_at(
                item_span(&item),
                "#[idempotent] applies to an `async fn` with a body (a free function or a method), not to this item",
            );
            let errors = cx.check().err().unwrap_or_default();
            return quote!(#errors #item);
        }
    };
    let args = args::parse(&cx, attr);
    let handler = handler::analyze(&cx, func, &args);
    match cx.check() {
        Ok(()) => expand(&handler, &args),
        Err(errors) => fallback(handler, errors),
    }
}

fn expand(handler: &Handler, args: &Args) -> TokenStream {
    let (Some(key), Some(store)) = (&args.key, &args.store) else {
        unreachable!("checked by args::parse")
    };
    let krate = &args.krate;
    let rt = quote!(#krate::__private);
    let func = &handler.func;
    let sig = &func.sig;
    let scope = args
        .scope
        .clone()
        .unwrap_or_else(|| LitStr::new(&sig.ident.to_string(), sig.ident.span()));
    let (ttl, lease) = (args.ttl_ms, args.lease_ms);

    let mixed = Span::mixed_site();
    let store_ref = format_ident!("__idem_store", span = mixed);
    let key_source = format_ident!("__idem_key_source", span = mixed);
    let key_text = format_ident!("__idem_key", span = mixed);
    let request = format_ident!("__idem_request", span = mixed);
    let span = format_ident!("__idem_span", span = mixed);
    let claim = format_ident!("__idem_claim", span = mixed);
    let guard = format_ident!("__idem_guard", span = mixed);
    let outcome = format_ident!("__idem_outcome", span = mixed);
    let fake = format_ident!("__idem_fake_return", span = mixed);
    let error = format_ident!("__idem_error", span = mixed);
    let replay = format_ident!("__idem_replay", span = mixed);

    let result_span = handler::result_span(handler);
    let error_span = handler.err_type.as_ref().map_or(result_span, Spanned::span);
    let into_error = quote_spanned!(error_span=> #rt::error);
    let fingerprint = match &args.fingerprint {
        Some(expr) => quote_spanned!(expr.span()=> #rt::fingerprint(&(#expr))),
        None => quote!(::core::result::Result::Ok(::core::option::Option::None)),
    };
    let bail = quote! {
        Err(#error) => return ::core::result::Result::Err(#into_error(#error)),
    };

    let claim_call = match &handler.tx {
        Some(tx) => {
            let at = tx.ty.span();
            quote_spanned!(at=> #rt::claim_transactional(#store_ref, &#request, &#span))
        }
        None => quote_spanned!(store.span()=> #rt::claim(#store_ref, &#request, &#span)),
    };
    let bind_tx = handler.tx.as_ref().map(|tx| {
        let pat = &tx.pat;
        let ty = &tx.ty;
        quote_spanned!(ty.span()=> let #pat: #ty = #rt::bind_transaction(&mut #guard);)
    });
    let guard_binding = if handler.tx.is_some() {
        quote!(mut #guard)
    } else {
        quote!(#guard)
    };

    let return_type = match &sig.output {
        ReturnType::Type(_, ty) => quote!(#ty),
        ReturnType::Default => quote!(()),
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
    let replay_call = quote_spanned!(result_span=> #rt::replay(#replay));
    let finish_call = quote_spanned!(result_span=> #rt::finish(#guard, #outcome, #span));

    let new_block: Block = syn::parse_quote! {{
        let (#claim, #span) = {
            #[allow(unused_parens, clippy::needless_borrow)]
            let #store_ref = &(#store);
            #[allow(unused_parens, clippy::needless_borrow)]
            let #key_source = &(#key);
            let #key_text = match #rt::key(#scope, #key_source) {
                Ok(key) => key,
                #bail
            };
            let #request = match #rt::request(#scope, &#key_text, #ttl, #lease, #fingerprint) {
                Ok(request) => request,
                #bail
            };
            let #span = #rt::span(&#request);
            (#claim_call.await, #span)
        };
        match #claim {
            ::core::result::Result::Err(#error) => ::core::result::Result::Err(#into_error(#error)),
            ::core::result::Result::Ok(#krate::Claim::Done(#replay)) => #replay_call,
            ::core::result::Result::Ok(#krate::Claim::Fresh(#guard_binding)) => {
                let #outcome = {
                    #bind_tx
                    #rt::Instrument::instrument(#body, ::core::clone::Clone::clone(&#span)).await
                };
                #finish_call.await
            }
        }
    }};

    let mut out = func.clone();
    out.sig.inputs = without_tx(handler);
    out.block = Box::new(new_block);
    quote!(#out)
}

/// The signature's parameters without the transaction parameter.
fn without_tx(handler: &Handler) -> Punctuated<FnArg, syn::Token![,]> {
    handler
        .func
        .sig
        .inputs
        .iter()
        .enumerate()
        .filter(|(index, _)| handler.tx.as_ref().is_none_or(|tx| tx.index != *index))
        .map(|(_, arg)| arg.clone())
        .collect()
}

/// After errors: the errors, and a stand-in function with the signature the
/// expansion would have had, so callers do not cascade into more errors.
fn fallback(handler: Handler, errors: TokenStream) -> TokenStream {
    let mut stub = handler.func.clone();
    stub.sig.inputs = without_tx(&handler);
    stub.sig.asyncness = Some(Default::default());
    stub.block = Box::new(syn::parse_quote!({ ::core::unreachable!() }));
    stub.attrs
        .push(syn::parse_quote!(#[allow(unused_variables, clippy::unused_async)]));
    quote!(#errors #stub)
}

/// Where to point "not a function": the item's keyword and name.
fn item_span(item: &TokenStream) -> Span {
    let mut tokens = item.clone().into_iter().skip_while(|token| {
        // Skip outer attributes: `#` and its bracket group.
        matches!(token, proc_macro2::TokenTree::Punct(p) if p.as_char() == '#')
            || matches!(token, proc_macro2::TokenTree::Group(g) if g.delimiter() == proc_macro2::Delimiter::Bracket)
    });
    let first = tokens.next();
    let second = tokens.next();
    match (first, second) {
        (Some(first), Some(second)) => first.span().join(second.span()).unwrap_or_else(|| first.span()),
        (Some(first), None) => first.span(),
        _ => Span::call_site(),
    }
}
