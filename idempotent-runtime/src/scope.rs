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
//! # Instantiations at types Rust cannot name
//!
//! Rust prints every closure (and async block) of one function alike,
//! `my_service::main::{{closure}}`, so `Consumer<F>::handle` at two closures
//! of `main` would have one path. A path that names such an anonymous type
//! (a `{{..}}` segment that is not followed by `::`) therefore gains `#` and
//! 16 hex digits of a hash of the instantiation's `TypeId`
//! (`my_service::Consumer<my_service::main::{{closure}}>::handle#1f0c..`):
//! each instantiation has its own markers. That hash is the same in every
//! process of one build, but may change with anything about the build (the
//! compiler's version, the package's version, features or dependencies), so
//! processes of two builds (a rolling deploy) do not see each other's
//! markers of these handlers; the first call at each such instantiation
//! logs a warning. Instantiate such a handler at named types instead (a
//! `fn` item, a struct implementing the trait): its scope is then the
//! readable path. (An explicit scope is one for all the instantiations.)
//!
//! Two values of one type are one instantiation, and one handler: two
//! `Consumer<Box<dyn Fn(..)>>` holding different closures share their
//! markers (give them different stores, or different types, to keep them
//! apart). Two types that Rust prints alike without a `{{..}}` (two
//! same-named types declared in two blocks of one function, one crate at
//! two versions) are told apart when the handler registers (below): the
//! second instantiation to claim gets [`Error::ScopeConflict`], never the
//! first one's markers.
//!
//! A path longer than [`MAX_SCOPE_BYTES`] keeps its
//! last bytes and gains a hash of the whole path, so it stays unique.
//!
//! # One scope, one handler
//!
//! In one process, a scope on one store belongs to the first handler that
//! uses it. Another handler (another function, another impl, or another
//! instantiation of a generic handler whose default scope reads the same)
//! that claims with the same scope on the same store gets
//! [`Error::ScopeConflict`] instead of silently skipping the first one's
//! messages, unless both say `shared_scope = true`. The instantiations of a
//! generic handler with an explicit scope are one handler: they share it.
//! The store is identified by
//! [`Store::namespace`](crate::store::Store::namespace) (database, table or
//! key prefix); stores that give none are not checked.

use std::any::TypeId;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, RwLock};

use sha2::{Digest, Sha256};

use crate::Error;
use crate::key::MAX_SCOPE_BYTES;

/// Which instantiation of a handler claims: the `TypeId` of a closure
/// written in its body (whose type carries every generic parameter of the
/// handler and of its impl), or [`Instance::ANY`] for a handler with an
/// explicit scope, whose instantiations are one handler.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Instance(Option<TypeId>);

impl Instance {
    /// Every instantiation: a handler whose scope is explicit.
    pub const ANY: Instance = Instance(None);

    /// The instantiation in which `probe`, a closure written in the
    /// handler's body, was made (its type need not be `'static`).
    #[inline]
    pub fn of<T: ?Sized>(_probe: &T) -> Instance {
        Instance(Some(typeid::of::<T>()))
    }

    /// 16 hex digits identifying this instantiation within one build.
    fn digest(self) -> String {
        struct Sha(Sha256);
        impl Hasher for Sha {
            fn write(&mut self, bytes: &[u8]) {
                self.0.update(bytes);
            }
            fn finish(&self) -> u64 {
                0
            }
        }
        let mut sha = Sha(Sha256::new());
        self.0.hash(&mut sha);
        sha.0.finalize()[..8].iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// A handler's path, from the type name of a closure written in its body:
/// the name without its trailing `::{{closure}}` segments.
#[doc(hidden)]
pub fn handler_path(closure_type_name: &'static str) -> &'static str {
    let mut path = closure_type_name;
    while let Some(stripped) = path.strip_suffix("::{{closure}}") {
        path = stripped;
    }
    if path.is_empty() { closure_type_name } else { path }
}

/// The default scope of the handler declared at `site`, at the
/// instantiation `instance`, whose path `path` gives: the path, with `#`
/// and the instantiation's hash when it names a type Rust cannot name
/// (see the module's documentation), made unique within
/// [`MAX_SCOPE_BYTES`] when longer. The first instantiation's scope is kept
/// in the site, so its calls compute nothing.
#[doc(hidden)]
#[inline]
pub fn default_scope(site: &'static Site, instance: Instance, path: fn() -> &'static str) -> &'static str {
    match site.scope.get() {
        Some(&(first, scope)) if first == instance => scope,
        _ => scope_of(site, instance, path()),
    }
}

/// The default scope of an instantiation whose scope is not the site's
/// first: computed again on each call (it is the first's, or interned).
fn scope_of(site: &'static Site, instance: Instance, path: &'static str) -> &'static str {
    let scope = match instance.0 {
        Some(type_id) if names_an_anonymous_type(path) => instantiated(type_id, instance, path),
        _ => fitted(path),
    };
    let _ = site.scope.set((instance, scope));
    scope
}

/// Whether `path` names an anonymous type: a `{{..}}` segment (how Rust
/// prints the type of a closure or an async block) that is not followed by
/// `::` (where it is only the place of a named item).
fn names_an_anonymous_type(path: &str) -> bool {
    path.match_indices("}}")
        .any(|(at, _)| !path[at + 2..].starts_with("::"))
}

/// `path#hash` for one instantiation, interned (and leaked) once.
fn instantiated(type_id: TypeId, instance: Instance, path: &'static str) -> &'static str {
    static SCOPES: OnceLock<RwLock<HashMap<TypeId, &'static str>>> = OnceLock::new();
    let scopes = SCOPES.get_or_init(Default::default);
    if let Some(scope) = scopes
        .read()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .get(&type_id)
    {
        return scope;
    }
    let mut scopes = scopes.write().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(scope) = scopes.get(&type_id) {
        return scope;
    }
    let full: &'static str = Box::leak(format!("{path}#{}", instance.digest()).into_boxed_str());
    let scope = fitted(full);
    tracing::warn!(
        target: "idempotent",
        scope,
        "handler {path} is instantiated at a type Rust cannot name (a closure or an async block): \
         its default scope ends with a hash that may change with the next build, and markers of \
         the old scope are not seen by the new one; instantiate it at a named type, or name its scope"
    );
    scopes.insert(type_id, scope);
    scope
}

/// `path`, or its shortened form when it does not fit in a scope.
fn fitted(path: &'static str) -> &'static str {
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
    /// The first `(namespace, scope, instance)` this site registered:
    /// calls with the same skip the registry.
    first: OnceLock<(&'static str, &'static str, Instance)>,
    /// The default scope of the first instantiation that asked for it.
    scope: OnceLock<(Instance, &'static str)>,
}

impl Site {
    /// A handler declared at `file:line`; `shared` is its `shared_scope`.
    pub const fn new(file: &'static str, line: u32, shared: bool) -> Site {
        Site {
            file,
            line,
            shared,
            first: OnceLock::new(),
            scope: OnceLock::new(),
        }
    }
}

/// Who owns a `(namespace, scope)` pair.
struct Owner {
    site: &'static Site,
    instance: Instance,
    handler: &'static str,
}

type Registry = Mutex<HashMap<(&'static str, &'static str), Owner>>;

fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// Checks that `scope` on the store `namespace` is not used by another
/// handler than `site` at `instance` in this process (unless both share it),
/// and records it. `handler` gives the handler's path, for the error
/// message (asked only when the pair is not yet this site's).
#[doc(hidden)]
pub fn register(
    site: &'static Site,
    instance: Instance,
    handler: fn() -> &'static str,
    scope: &'static str,
    namespace: Option<&'static str>,
) -> Result<(), Error> {
    let Some(namespace) = namespace else {
        return Ok(());
    };
    if let Some(&(first_namespace, first_scope, first_instance)) = site.first.get()
        && first_instance == instance
        && same(first_namespace, namespace)
        && same(first_scope, scope)
    {
        return Ok(());
    }
    let handler = handler();
    let mut owners = registry().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    match owners.get(&(namespace, scope)) {
        Some(owner) if std::ptr::eq(owner.site, site) && owner.instance == instance => {}
        Some(owner) if owner.site.shared && site.shared => {}
        Some(owner) => {
            let handler = if std::ptr::eq(owner.site, site) {
                format!(
                    "{handler} ({}:{}) at another instantiation, whose types Rust prints alike (rename one of the types)",
                    site.file, site.line
                )
            } else {
                format!("{handler} ({}:{})", site.file, site.line)
            };
            let error = Error::ScopeConflict {
                scope: scope.to_owned(),
                handler,
                other: format!("{} ({}:{})", owner.handler, owner.site.file, owner.site.line),
            };
            tracing::error!(target: "idempotent", %error, "two handlers use one scope");
            return Err(error);
        }
        None => {
            owners.insert(
                (namespace, scope),
                Owner {
                    site,
                    instance,
                    handler,
                },
            );
        }
    }
    drop(owners);
    let _ = site.first.set((namespace, scope, instance));
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
    fn the_handler_path_strips_closure_segments() {
        assert_eq!(
            handler_path("app::billing::process::{{closure}}::{{closure}}"),
            "app::billing::process"
        );
        assert_eq!(
            handler_path("<app::Billing as app::Handler>::handle::{{closure}}"),
            "<app::Billing as app::Handler>::handle"
        );
    }

    #[test]
    fn long_paths_are_shortened_uniquely_and_stably() {
        let a: &'static str = Box::leak(format!("{}::a::{{{{closure}}}}", "x".repeat(300)).into_boxed_str());
        let b: &'static str = Box::leak(format!("{}::a::{{{{closure}}}}", "y".repeat(300)).into_boxed_str());
        let (sa, sb) = (fitted(handler_path(a)), fitted(handler_path(b)));
        assert!(sa.len() <= MAX_SCOPE_BYTES && sb.len() <= MAX_SCOPE_BYTES);
        assert_ne!(sa, sb, "same tail, different paths: different scopes");
        assert!(sa.starts_with('~') && sa.contains("::a#"), "{sa}");
        assert!(std::ptr::eq(sa, fitted(handler_path(a))), "interned");
    }

    #[test]
    fn anonymous_types_are_told_from_items_declared_inside_closures() {
        for anonymous in [
            "app::Consumer<app::main::{{closure}}>::handle",
            "app::apply<app::main::{{closure}}::{{closure}}>",
            "<app::main::{{closure}} as app::Handler>::handle",
            "app::apply<(u8, app::main::{{closure}})>",
        ] {
            assert!(names_an_anonymous_type(anonymous), "{anonymous}");
        }
        for named in [
            "app::Consumer<app::Charge>::handle",
            "app::main::{{closure}}::handle",
            "app::Consumer<app::main::{{closure}}::Local>::handle",
            "app::Consumer<alloc::boxed::Box<dyn core::ops::function::Fn() -> u32>>::handle",
        ] {
            assert!(!names_an_anonymous_type(named), "{named}");
        }
    }

    /// The default scope of `Probe<F>::handle` (a stand-in for a generic
    /// handler's expansion) at the instantiation `F`.
    struct Probe<F>(F);

    static PROBED: Site = Site::new("probe.rs", 1, false);

    impl<F> Probe<F> {
        fn scope(&self) -> (Instance, &'static str) {
            let probe = || handler_path(std::any::type_name_of_val(&|| ()));
            let instance = Instance::of(&probe);
            (instance, default_scope(&PROBED, instance, probe))
        }
    }

    #[test]
    fn closures_get_a_scope_each() {
        let (a, b) = (Probe(|| 1), Probe(|| 2));
        let ((ia, sa), (ib, sb)) = (a.scope(), b.scope());
        assert_ne!(ia, ib);
        assert_ne!(sa, sb, "two closures of one function: two scopes");
        for scope in [sa, sb] {
            // `{path}#{hash}`, here shortened too (`~{tail}#{hash}`).
            assert!(scope.len() <= MAX_SCOPE_BYTES, "{scope}");
            assert!(scope.contains("{{closure}}>::scope#"), "{scope}");
        }
        assert!(
            std::ptr::eq(a.scope().1, sa) && std::ptr::eq(b.scope().1, sb),
            "interned"
        );
        // Named types keep the readable path.
        fn named() {}
        let (_, named_scope) = Probe(named).scope();
        assert_eq!(
            named_scope,
            "idempotent_runtime::scope::tests::Probe<idempotent_runtime::scope::tests::closures_get_a_scope_each::named>::scope"
        );
    }

    #[test]
    fn a_scope_belongs_to_one_site_unless_both_share_it() {
        static A: Site = Site::new("a.rs", 1, false);
        static B: Site = Site::new("b.rs", 2, false);
        static SA: Site = Site::new("c.rs", 3, true);
        static SB: Site = Site::new("d.rs", 4, true);
        const ANY: Instance = Instance::ANY;
        let ns = intern_namespace("test://scope-registry".into());
        register(&A, ANY, || "a", "s1", Some(ns)).unwrap();
        register(&A, ANY, || "a", "s1", Some(ns)).unwrap();
        let err = register(&B, ANY, || "b", "s1", Some(ns)).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("b (b.rs:2)") && text.contains("a (a.rs:1)"), "{text}");
        // Another store: no conflict.
        register(&B, ANY, || "b", "s1", Some(intern_namespace("test://other".into()))).unwrap();
        // Stores without a namespace are not checked.
        register(&B, ANY, || "b", "s1", None).unwrap();
        register(&SA, ANY, || "sa", "s2", Some(ns)).unwrap();
        register(&SB, ANY, || "sb", "s2", Some(ns)).unwrap();
        assert!(register(&A, ANY, || "a", "s2", Some(ns)).is_err(), "only sharers share");

        // One site at two instantiations with one scope text: refused.
        static G: Site = Site::new("g.rs", 5, false);
        let (one, two) = (Instance::of(&0u8), Instance::of(&0u16));
        register(&G, one, || "g", "s3", Some(ns)).unwrap();
        register(&G, one, || "g", "s3", Some(ns)).unwrap();
        let text = register(&G, two, || "g", "s3", Some(ns)).unwrap_err().to_string();
        assert!(text.contains("g (g.rs:5) at another instantiation"), "{text}");
        // Even after the site's first pair was recorded (its fast path).
        assert!(register(&G, two, || "g", "s3", Some(ns)).is_err());
    }
}
