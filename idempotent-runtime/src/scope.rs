//! Scopes: the namespace of a handler's markers, and the rule that two
//! different handlers never share one by accident.
//!
//! # The default scope
//!
//! A handler without `scope = ".."` gets its own path as its scope, as Rust
//! prints it: `my_service::billing::process` for a free function,
//! `my_service::billing::Billing::handle` for an inherent method,
//! `<my_service::Billing as my_service::Handler>::handle` for a trait
//! method, `my_service::Consumer<my_service::Billing>::handle` for a method
//! of a generic type at one instantiation. Two handlers that are different
//! functions (same-named methods of two impls, same-named functions in two
//! modules, one generic handler at two types) therefore never share markers.
//!
//! The path is taken from the type name of a closure in the handler's body
//! ([`std::any::type_name_of_val`]), so it names the crate, the module, the
//! impl (with its trait) and the generic arguments, and not the lifetimes.
//! It changes when any of these does: renaming the crate, the module or its
//! file, the type, the trait or the function, moving the function, or
//! instantiating it at other types; and the standard library documents the
//! text of type names as free to change between compiler versions. A
//! changed scope does not see the markers of the old one, so a message
//! processed before the change would be processed again: **give production
//! handlers an explicit `scope`**, which nothing but you changes.
//!
//! A path longer than [`MAX_SCOPE_BYTES`] keeps its
//! last bytes and gains a hash of the whole path, so it stays unique.
//!
//! # One scope, one handler
//!
//! In one process, a scope on one store belongs to the first handler that
//! uses it. Another handler (another function, another impl) that claims
//! with the same scope on the same store gets [`Error::ScopeConflict`]
//! instead of silently skipping the first one's messages, unless both say
//! `shared_scope = true`. The store is identified by
//! [`Store::namespace`](crate::store::Store::namespace) (database, table or key
//! prefix); stores that give none are not checked.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use sha2::{Digest, Sha256};

use crate::Error;
use crate::key::MAX_SCOPE_BYTES;

/// The default scope of a handler, from the type name of a closure written
/// in its body: the name without its trailing `::{{closure}}` segments, made
/// unique within [`MAX_SCOPE_BYTES`] when longer.
#[doc(hidden)]
pub fn default_scope(closure_type_name: &'static str) -> &'static str {
    let mut path = closure_type_name;
    while let Some(stripped) = path.strip_suffix("::{{closure}}") {
        path = stripped;
    }
    if path.is_empty() {
        path = closure_type_name;
    }
    if path.len() <= MAX_SCOPE_BYTES && !path.contains('\0') {
        return path;
    }
    shortened(path)
}

/// A path too long for a scope: `~{tail}#{hash}`, interned so each path is
/// shortened (and leaked) once.
fn shortened(path: &'static str) -> &'static str {
    static SHORT: OnceLock<Mutex<HashMap<&'static str, &'static str>>> = OnceLock::new();
    let map = SHORT.get_or_init(Default::default);
    let mut map = map.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(short) = map.get(path) {
        return short;
    }
    let digest = Sha256::digest(path.as_bytes());
    let hash: String = digest[..8].iter().map(|b| format!("{b:02x}")).collect();
    // `~` + tail + `#` + 16 hex digits.
    let room = MAX_SCOPE_BYTES - 2 - hash.len();
    let mut start = path.len().saturating_sub(room);
    while !path.is_char_boundary(start) {
        start += 1;
    }
    let tail = path[start..].replace('\0', "");
    let short: &'static str = Box::leak(format!("~{tail}#{hash}").into_boxed_str());
    map.insert(path, short);
    short
}

/// Where a handler is declared: one `static` per `#[idempotent]` function,
/// written by the expansion. Its address identifies the handler.
#[doc(hidden)]
#[derive(Debug)]
pub struct Site {
    file: &'static str,
    line: u32,
    shared: bool,
    /// The first `(namespace, scope)` pair this site registered: calls with
    /// the same pair skip the registry.
    first: OnceLock<(&'static str, &'static str)>,
}

impl Site {
    /// A handler declared at `file:line`; `shared` is its `shared_scope`.
    pub const fn new(file: &'static str, line: u32, shared: bool) -> Site {
        Site {
            file,
            line,
            shared,
            first: OnceLock::new(),
        }
    }
}

/// Who owns a `(namespace, scope)` pair.
struct Owner {
    site: &'static Site,
    handler: &'static str,
}

type Registry = Mutex<HashMap<(&'static str, &'static str), Owner>>;

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// Checks that `scope` on the store `namespace` is not used by another
/// handler than `site` in this process (unless both share it), and records
/// it. `handler` gives the handler's path, for the error message (asked
/// only when the pair is not yet this site's).
#[doc(hidden)]
pub fn register(
    site: &'static Site,
    handler: fn() -> &'static str,
    scope: &'static str,
    namespace: Option<&'static str>,
) -> Result<(), Error> {
    let Some(namespace) = namespace else {
        return Ok(());
    };
    if let Some(&(first_namespace, first_scope)) = site.first.get()
        && same(first_namespace, namespace)
        && same(first_scope, scope)
    {
        return Ok(());
    }
    let handler = handler();
    let mut owners = registry().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    match owners.get(&(namespace, scope)) {
        Some(owner) if std::ptr::eq(owner.site, site) => {}
        Some(owner) if owner.site.shared && site.shared => {}
        Some(owner) => {
            let error = Error::ScopeConflict {
                scope: scope.to_owned(),
                handler: format!("{handler} ({}:{})", site.file, site.line),
                other: format!("{} ({}:{})", owner.handler, owner.site.file, owner.site.line),
            };
            tracing::error!(target: "idempotent", %error, "two handlers use one scope");
            return Err(error);
        }
        None => {
            owners.insert((namespace, scope), Owner { site, handler });
        }
    }
    drop(owners);
    let _ = site.first.set((namespace, scope));
    Ok(())
}

/// Equal texts, compared by address first (a site's calls pass the same
/// `&'static str` every time).
#[inline]
fn same(a: &str, b: &str) -> bool {
    std::ptr::eq(a, b) || a == b
}

/// Interns a store's namespace text, so that equal namespaces are one
/// `&'static str` (stores are built a bounded number of times).
pub fn intern_namespace(namespace: String) -> &'static str {
    static NAMES: OnceLock<Mutex<HashMap<String, &'static str>>> = OnceLock::new();
    let names = NAMES.get_or_init(Default::default);
    let mut names = names.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(interned) = names.get(&namespace) {
        return interned;
    }
    let interned: &'static str = Box::leak(namespace.clone().into_boxed_str());
    names.insert(namespace, interned);
    interned
}

/// A namespace of its own for a store that lives in this process only
/// (`MemoryStore`): `"{kind}#{n}"`, never reused.
pub(crate) fn unique_namespace(kind: &str) -> &'static str {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    intern_namespace(format!("{kind}#{}", NEXT.fetch_add(1, Ordering::Relaxed)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_scope_strips_closure_segments() {
        assert_eq!(
            default_scope("app::billing::process::{{closure}}::{{closure}}"),
            "app::billing::process"
        );
        assert_eq!(
            default_scope("<app::Billing as app::Handler>::handle::{{closure}}"),
            "<app::Billing as app::Handler>::handle"
        );
    }

    #[test]
    fn long_paths_are_shortened_uniquely_and_stably() {
        let a: &'static str = Box::leak(format!("{}::a::{{{{closure}}}}", "x".repeat(300)).into_boxed_str());
        let b: &'static str = Box::leak(format!("{}::a::{{{{closure}}}}", "y".repeat(300)).into_boxed_str());
        let (sa, sb) = (default_scope(a), default_scope(b));
        assert!(sa.len() <= MAX_SCOPE_BYTES && sb.len() <= MAX_SCOPE_BYTES);
        assert_ne!(sa, sb, "same tail, different paths: different scopes");
        assert!(sa.starts_with('~') && sa.contains("::a#"), "{sa}");
        assert!(std::ptr::eq(sa, default_scope(a)), "interned");
    }

    #[test]
    fn a_scope_belongs_to_one_site_unless_both_share_it() {
        static A: Site = Site::new("a.rs", 1, false);
        static B: Site = Site::new("b.rs", 2, false);
        static SA: Site = Site::new("c.rs", 3, true);
        static SB: Site = Site::new("d.rs", 4, true);
        let ns = intern_namespace("test://scope-registry".into());
        register(&A, || "a", "s1", Some(ns)).unwrap();
        register(&A, || "a", "s1", Some(ns)).unwrap();
        let err = register(&B, || "b", "s1", Some(ns)).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("b (b.rs:2)") && text.contains("a (a.rs:1)"), "{text}");
        // Another store: no conflict.
        register(&B, || "b", "s1", Some(intern_namespace("test://other".into()))).unwrap();
        // Stores without a namespace are not checked.
        register(&B, || "b", "s1", None).unwrap();
        register(&SA, || "sa", "s2", Some(ns)).unwrap();
        register(&SB, || "sb", "s2", Some(ns)).unwrap();
        assert!(register(&A, || "a", "s2", Some(ns)).is_err(), "only sharers share");
    }
}
