//! Scopes: two handlers that are different functions never share markers
//! unless both name one scope and say `shared_scope = true`.
//!
//! Every shape a service uses is here, each with its two handlers on one
//! store and one key: both bodies must run. Then the default scope's exact
//! text (what changes it is documented), explicit scopes that two handlers
//! claim (refused with `Error::ScopeConflict`, or shared when both say so),
//! and default scopes longer than a marker's scope column on every store.

mod common;

use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};

use idempotent_runtime::sqlx::{self, AssertSqlSafe, PgConnection};
use idempotent_runtime::store::Store;
use idempotent_runtime::{Error, MemoryStore, PgStore, idempotent};

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error(transparent)]
    Idem(#[from] Error),
    #[error(transparent)]
    Db(#[from] sqlx::Error),
}

pub struct Msg {
    pub id: String,
}

/// Which bodies ran, in order.
#[derive(Default)]
pub struct Log(Mutex<Vec<&'static str>>);

impl Log {
    fn ran(&self, who: &'static str) {
        self.0.lock().unwrap().push(who);
    }
    fn runs(&self) -> Vec<&'static str> {
        self.0.lock().unwrap().clone()
    }
}

fn msg() -> Msg {
    Msg {
        id: common::unique("scope-msg"),
    }
}

// ---- trait impls ---------------------------------------------------------

pub trait Handler {
    fn handle(&self, msg: &Msg) -> impl std::future::Future<Output = Result<(), AppError>> + Send;
}

pub struct Billing<S> {
    store: S,
    log: Log,
}

pub struct Shipping<S> {
    store: S,
    log: Log,
}

impl<S: Store> Handler for Billing<S> {
    #[idempotent(key = "msg.id", store = self.store)]
    async fn handle(&self, msg: &Msg) -> Result<(), AppError> {
        self.log.ran("billing");
        Ok(())
    }
}

impl<S: Store> Handler for Shipping<S> {
    #[idempotent(key = "msg.id", store = self.store)]
    async fn handle(&self, msg: &Msg) -> Result<(), AppError> {
        self.log.ran("shipping");
        Ok(())
    }
}

#[tokio::test]
async fn trait_impls_of_two_types_keep_their_own_markers() {
    let store = MemoryStore::new();
    let billing = Billing {
        store: store.clone(),
        log: Log::default(),
    };
    let shipping = Shipping {
        store: store.clone(),
        log: Log::default(),
    };
    let m = msg();
    for _ in 0..2 {
        billing.handle(&m).await.unwrap();
        shipping.handle(&m).await.unwrap();
    }
    assert_eq!(billing.log.runs(), ["billing"]);
    assert_eq!(
        shipping.log.runs(),
        ["shipping"],
        "Shipping's body ran once, not skipped"
    );
}

// ---- inherent methods of two types ----------------------------------------

pub struct Invoices {
    store: MemoryStore,
    log: Log,
}

pub struct Receipts {
    store: MemoryStore,
    log: Log,
}

impl Invoices {
    #[idempotent(key = "msg.id", store = self.store)]
    async fn process(&self, msg: &Msg) -> Result<u32, AppError> {
        self.log.ran("invoices");
        Ok(1)
    }

    /// An associated function without a receiver.
    #[idempotent(key = "msg.id", store = store)]
    async fn record(store: &MemoryStore, msg: &Msg, log: &Log) -> Result<(), AppError> {
        log.ran("invoices::record");
        Ok(())
    }
}

impl Receipts {
    #[idempotent(key = "msg.id", store = self.store)]
    async fn process(&self, msg: &Msg) -> Result<u32, AppError> {
        self.log.ran("receipts");
        Ok(2)
    }

    #[idempotent(key = "msg.id", store = store)]
    async fn record(store: &MemoryStore, msg: &Msg, log: &Log) -> Result<(), AppError> {
        log.ran("receipts::record");
        Ok(())
    }
}

#[tokio::test]
async fn inherent_methods_of_two_types_keep_their_own_markers() {
    let store = MemoryStore::new();
    let invoices = Invoices {
        store: store.clone(),
        log: Log::default(),
    };
    let receipts = Receipts {
        store: store.clone(),
        log: Log::default(),
    };
    let m = msg();
    for _ in 0..2 {
        assert_eq!(invoices.process(&m).await.unwrap(), 1);
        assert_eq!(receipts.process(&m).await.unwrap(), 2, "not the other handler's replay");
    }
    assert_eq!(invoices.log.runs(), ["invoices"]);
    assert_eq!(receipts.log.runs(), ["receipts"]);

    // Associated functions without a receiver, same name, same module.
    let log = Log::default();
    for _ in 0..2 {
        Invoices::record(&store, &m, &log).await.unwrap();
        Receipts::record(&store, &m, &log).await.unwrap();
    }
    assert_eq!(log.runs(), ["invoices::record", "receipts::record"]);
}

// ---- free functions in two modules -----------------------------------------

mod billing {
    use super::*;

    #[idempotent(key = "msg.id", store = store)]
    pub async fn process(store: &PgStore, msg: &Msg, log: &Log, tx: &mut PgConnection) -> Result<(), AppError> {
        sqlx::query("SELECT 1").execute(&mut *tx).await?;
        log.ran("billing::process");
        Ok(())
    }
}

mod shipping {
    use super::*;

    #[idempotent(key = "msg.id", store = store)]
    pub async fn process(store: &PgStore, msg: &Msg, log: &Log, tx: &mut PgConnection) -> Result<(), AppError> {
        sqlx::query("SELECT 1").execute(&mut *tx).await?;
        log.ran("shipping::process");
        Ok(())
    }
}

#[tokio::test]
async fn free_functions_of_two_modules_keep_their_own_markers_in_postgres() {
    let pool = common::pg_pool(4).await;
    let table = common::unique("scopes");
    let store = PgStore::builder(pool.clone()).table(&table).build().unwrap();
    store.migrate().await.unwrap();
    let (log, m) = (Log::default(), msg());
    for _ in 0..2 {
        billing::process(&store, &m, &log).await.unwrap();
        shipping::process(&store, &m, &log).await.unwrap();
    }
    assert_eq!(log.runs(), ["billing::process", "shipping::process"]);
    // The default scope is the function's path: this is the text that
    // renaming or moving the function changes (see docs/handlers.md, "Scopes").
    let scopes: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT scope FROM {table} WHERE message_id = $1 ORDER BY scope"
    )))
    .bind(&m.id)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(scopes, ["scopes::billing::process", "scopes::shipping::process"]);
    common::drop_pg_table(&pool, &table).await;
}

// ---- generics ---------------------------------------------------------------

pub trait Effect: Send + Sync + 'static {
    const NAME: &'static str;
}

pub struct Charge;
pub struct Notify;

impl Effect for Charge {
    const NAME: &'static str = "charge";
}

impl Effect for Notify {
    const NAME: &'static str = "notify";
}

#[idempotent(key = "msg.id", store = store)]
async fn apply<E: Effect>(store: &MemoryStore, msg: &Msg, log: &Log) -> Result<String, AppError> {
    log.ran(E::NAME);
    Ok(E::NAME.to_owned())
}

pub struct Consumer<E> {
    store: MemoryStore,
    log: Log,
    _effect: std::marker::PhantomData<E>,
}

impl<E: Effect> Consumer<E> {
    #[idempotent(key = "msg.id", store = self.store)]
    async fn consume(&self, msg: &Msg) -> Result<String, AppError> {
        self.log.ran(E::NAME);
        Ok(E::NAME.to_owned())
    }
}

/// One explicit scope on a generic handler: every instantiation shares it
/// (the user named it once).
#[idempotent(key = "msg.id", store = store, scope = "one-generic-scope")]
async fn apply_named<E: Effect>(store: &MemoryStore, msg: &Msg, log: &Log) -> Result<String, AppError> {
    log.ran(E::NAME);
    Ok(E::NAME.to_owned())
}

#[tokio::test]
async fn a_generic_handler_at_two_types_is_two_handlers() {
    let store = MemoryStore::new();
    let (log, m) = (Log::default(), msg());
    for _ in 0..2 {
        assert_eq!(apply::<Charge>(&store, &m, &log).await.unwrap(), "charge");
        assert_eq!(apply::<Notify>(&store, &m, &log).await.unwrap(), "notify");
    }
    assert_eq!(log.runs(), ["charge", "notify"]);

    let charge = Consumer::<Charge> {
        store: store.clone(),
        log: Log::default(),
        _effect: std::marker::PhantomData,
    };
    let notify = Consumer::<Notify> {
        store: store.clone(),
        log: Log::default(),
        _effect: std::marker::PhantomData,
    };
    for _ in 0..2 {
        assert_eq!(charge.consume(&m).await.unwrap(), "charge");
        assert_eq!(notify.consume(&m).await.unwrap(), "notify");
    }
    assert_eq!((charge.log.runs(), notify.log.runs()), (vec!["charge"], vec!["notify"]));

    let log = Log::default();
    assert_eq!(apply_named::<Charge>(&store, &m, &log).await.unwrap(), "charge");
    assert_eq!(
        apply_named::<Notify>(&store, &m, &log).await.unwrap(),
        "charge",
        "an explicit scope is shared by the instantiations: the replay"
    );
    assert_eq!(log.runs(), ["charge"]);
}

// ---- instantiations whose type names say nothing ------------------------------

/// A consumer generic over its effect, as services write them: the effect
/// is a closure, a function, or a boxed trait object.
pub struct Handle<F> {
    effect: F,
    runs: AtomicU32,
}

impl<F> Handle<F> {
    fn new(effect: F) -> Self {
        Handle {
            effect,
            runs: AtomicU32::new(0),
        }
    }

    fn runs(&self) -> u32 {
        self.runs.load(Ordering::SeqCst)
    }
}

impl<F: Fn(&Msg) -> u32 + Send + Sync> Handle<F> {
    #[idempotent(key = "msg.id", store = store)]
    async fn handle<S: Store>(&self, store: &S, msg: &Msg) -> Result<u32, AppError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        Ok((self.effect)(msg))
    }
}

/// The same through a trait: `<Handle<F> as Answer>::answer`.
pub trait Answer {
    fn answer(&self, store: &MemoryStore, msg: &Msg)
    -> impl std::future::Future<Output = Result<u32, AppError>> + Send;
}

impl<F: Fn(&Msg) -> u32 + Send + Sync> Answer for Handle<F> {
    #[idempotent(key = "msg.id", store = store)]
    async fn answer(&self, store: &MemoryStore, msg: &Msg) -> Result<u32, AppError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        Ok((self.effect)(msg) + 100)
    }
}

/// An effect behind a trait object: every `Handle<Boxed>` is one type.
type Boxed = Box<dyn Fn(&Msg) -> u32 + Send + Sync>;

/// A generic free function instantiated at closures.
#[idempotent(key = "msg.id", store = store)]
async fn run_effect<F: Fn(&Msg) -> u32 + Send + Sync>(
    store: &MemoryStore,
    msg: &Msg,
    effect: &F,
    runs: &AtomicU32,
) -> Result<u32, AppError> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(effect(msg))
}

fn charge(_: &Msg) -> u32 {
    10
}

fn notify(_: &Msg) -> u32 {
    20
}

/// Both handles process `m` twice: each body runs once and answers its own
/// result (the second call is each one's own duplicate).
async fn each_runs_once<A, B, S>(a: &Handle<A>, b: &Handle<B>, store: &S, m: &Msg) -> (u32, u32)
where
    A: Fn(&Msg) -> u32 + Send + Sync,
    B: Fn(&Msg) -> u32 + Send + Sync,
    S: Store,
{
    let mut answers = (0, 0);
    for _ in 0..2 {
        answers = (a.handle(store, m).await.unwrap(), b.handle(store, m).await.unwrap());
    }
    answers
}

#[tokio::test]
async fn two_closures_of_one_function_are_two_handlers() {
    let store = MemoryStore::new();
    let m = msg();
    // Two closures of one function: Rust prints both types the same
    // (`scopes::..::{{closure}}`), yet they are two instantiations.
    let a = Handle::new(|_: &Msg| 1);
    let b = Handle::new(|_: &Msg| 2);
    assert_eq!(
        each_runs_once(&a, &b, &store, &m).await,
        (1, 2),
        "the second closure's handler answered with the first one's result"
    );
    assert_eq!((a.runs(), b.runs()), (1, 1), "each body ran once");

    // A trait method of the generic type, likewise.
    let m = msg();
    for _ in 0..2 {
        assert_eq!(a.answer(&store, &m).await.unwrap(), 101);
        assert_eq!(b.answer(&store, &m).await.unwrap(), 102);
    }
    assert_eq!((a.runs(), b.runs()), (2, 2));

    // A generic function at two closures, likewise.
    let (runs_a, runs_b) = (AtomicU32::new(0), AtomicU32::new(0));
    let (fa, fb) = (|_: &Msg| 3, |_: &Msg| 4);
    for _ in 0..2 {
        assert_eq!(run_effect(&store, &m, &fa, &runs_a).await.unwrap(), 3);
        assert_eq!(run_effect(&store, &m, &fb, &runs_b).await.unwrap(), 4);
    }
    assert_eq!((runs_a.into_inner(), runs_b.into_inner()), (1, 1));
}

#[tokio::test]
async fn values_of_one_type_are_one_handler_and_share_its_markers() {
    // Two values of one instantiation, `Handle<Box<dyn Fn>>`, holding two
    // different closures: one handler (documented in docs/handlers.md,
    // "Scopes"), so the second is a duplicate of the first, not a conflict.
    let store = MemoryStore::new();
    let m = msg();
    let a: Handle<Boxed> = Handle::new(Box::new(|_: &Msg| 1));
    let b: Handle<Boxed> = Handle::new(Box::new(|_: &Msg| 2));
    assert_eq!(
        each_runs_once(&a, &b, &store, &m).await,
        (1, 1),
        "one handler: the replay"
    );
    assert_eq!((a.runs(), b.runs()), (1, 0));
    // Unless they keep their markers in different stores.
    let other = MemoryStore::new();
    assert_eq!(b.handle(&other, &m).await.unwrap(), 2);
    assert_eq!(b.runs(), 1);
}

/// A generic handler whose instantiations the registry must tell apart.
pub struct Tagged<T>(std::marker::PhantomData<T>);

impl<T: Send + Sync> Tagged<T> {
    #[idempotent(key = "msg.id", store = store)]
    async fn handle(store: &MemoryStore, msg: &Msg, answer: u32) -> Result<u32, AppError> {
        Ok(answer)
    }
}

#[tokio::test]
async fn two_types_printed_alike_are_refused_not_shared() {
    // Two types that Rust prints with one name (`..::Local`, declared in two
    // blocks of one function) whose scope carries no marker of ambiguity:
    // the second instantiation is refused, never answered with the first's
    // result.
    let store = MemoryStore::new();
    let m = msg();
    let first = {
        struct Local;
        Tagged::<Local>::handle(&store, &m, 1).await.unwrap()
    };
    assert_eq!(first, 1);
    let second = {
        struct Local;
        Tagged::<Local>::handle(&store, &m, 2).await
    };
    let Err(AppError::Idem(Error::ScopeConflict { scope, handler, other })) = &second else {
        panic!("expected ScopeConflict, got {second:?}");
    };
    assert!(scope.starts_with("scopes::Tagged<scopes::"), "{scope}");
    assert!(handler.contains("another instantiation"), "{handler}");
    assert!(other.starts_with("scopes::Tagged<"), "{other}");
}

#[tokio::test]
async fn generic_handler_instantiations_keep_their_own_markers_in_postgres() {
    let pool = common::pg_pool(4).await;
    let table = common::unique("generic_scopes");
    let store = PgStore::builder(pool.clone()).table(&table).build().unwrap();
    store.migrate().await.unwrap();

    // Two closures of one function.
    let m = msg();
    let a = Handle::new(|_: &Msg| 1);
    let b = Handle::new(|_: &Msg| 2);
    assert_eq!(each_runs_once(&a, &b, &store, &m).await, (1, 2));
    assert_eq!((a.runs(), b.runs()), (1, 1));
    let closures = scopes_of(&pool, &table, &m.id).await;
    assert_eq!(closures.len(), 2, "{closures:?}");
    for scope in &closures {
        // The readable path with `#` and the instantiation's hash; this one
        // is long, so it is shortened too (`~{tail}#{hash}`).
        assert!(scope.contains("{{closure}}>::handle<"), "{scope}");
        assert!(scope.contains("PgStore>#"), "{scope}");
        assert!(scope.len() <= idempotent_runtime::MAX_SCOPE_BYTES, "{scope}");
    }

    // One generic type at two named types: readable, stable scopes.
    let m = msg();
    let (c, n) = (Handle::new(charge), Handle::new(notify));
    assert_eq!(each_runs_once(&c, &n, &store, &m).await, (10, 20));
    assert_eq!((c.runs(), n.runs()), (1, 1));
    assert_eq!(
        scopes_of(&pool, &table, &m.id).await,
        [
            "scopes::Handle<scopes::charge>::handle<idempotent_runtime::store::postgres::PgStore>",
            "scopes::Handle<scopes::notify>::handle<idempotent_runtime::store::postgres::PgStore>"
        ]
    );

    // Two values of one instantiation: one handler, one marker.
    let m = msg();
    let x: Handle<Boxed> = Handle::new(Box::new(|_: &Msg| 1));
    let y: Handle<Boxed> = Handle::new(Box::new(|_: &Msg| 2));
    assert_eq!(each_runs_once(&x, &y, &store, &m).await, (1, 1));
    assert_eq!((x.runs(), y.runs()), (1, 0));
    let boxed = scopes_of(&pool, &table, &m.id).await;
    assert_eq!(boxed.len(), 1, "{boxed:?}");
    // Shortened (`~{tail}#{hash}`), without an instantiation's hash: the
    // type is named.
    assert!(boxed[0].contains("Sync>>::handle<"), "{boxed:?}");
    assert_eq!(boxed[0].matches('#').count(), 1, "{boxed:?}");
    common::drop_pg_table(&pool, &table).await;
}

async fn scopes_of(pool: &sqlx::PgPool, table: &str, key: &str) -> Vec<String> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT scope FROM {table} WHERE message_id = $1 ORDER BY scope"
    )))
    .bind(key)
    .fetch_all(pool)
    .await
    .unwrap()
}

// ---- explicit scopes claimed by two handlers ---------------------------------

#[idempotent(key = "msg.id", store = store, scope = "payments")]
async fn pay(store: &MemoryStore, msg: &Msg, log: &Log) -> Result<(), AppError> {
    log.ran("pay");
    Ok(())
}

/// A copy of `pay` whose scope was not changed.
#[idempotent(key = "msg.id", store = store, scope = "payments")]
async fn refund(store: &MemoryStore, msg: &Msg, log: &Log) -> Result<(), AppError> {
    log.ran("refund");
    Ok(())
}

#[idempotent(key = "msg.id", store = store, scope = "audit", shared_scope = true)]
async fn audit_from_queue(store: &MemoryStore, msg: &Msg, log: &Log) -> Result<(), AppError> {
    log.ran("audit_from_queue");
    Ok(())
}

#[idempotent(key = "msg.id", store = store, scope = "audit", shared_scope = true)]
async fn audit_from_replay(store: &MemoryStore, msg: &Msg, log: &Log) -> Result<(), AppError> {
    log.ran("audit_from_replay");
    Ok(())
}

#[tokio::test]
async fn one_explicit_scope_on_two_handlers_is_refused_unless_both_share_it() {
    let store = MemoryStore::new();
    let (log, m) = (Log::default(), msg());
    pay(&store, &m, &log).await.unwrap();
    let err = refund(&store, &m, &log).await.unwrap_err();
    let AppError::Idem(Error::ScopeConflict { scope, handler, other }) = &err else {
        panic!("expected ScopeConflict, got {err:?}");
    };
    assert_eq!(scope, "payments");
    assert!(handler.starts_with("scopes::refund (tests/scopes.rs:"), "{handler}");
    assert!(other.starts_with("scopes::pay (tests/scopes.rs:"), "{other}");
    assert!(
        !Error::ScopeConflict {
            scope: String::new(),
            handler: String::new(),
            other: String::new()
        }
        .is_transient()
    );
    // Refused on every call, before any claim: the owner keeps working.
    assert!(refund(&store, &msg(), &log).await.is_err());
    pay(&store, &msg(), &log).await.unwrap();
    assert_eq!(log.runs(), ["pay", "pay"]);

    // On another store the scope is free.
    let other_store = MemoryStore::new();
    refund(&other_store, &m, &log).await.unwrap();

    // Declared shared on both: one set of markers.
    let log = Log::default();
    audit_from_queue(&store, &m, &log).await.unwrap();
    audit_from_replay(&store, &m, &log).await.unwrap();
    assert_eq!(log.runs(), ["audit_from_queue"], "shared: the second is a duplicate");
}

// ---- long default scopes on every store ---------------------------------------

pub mod a_module_with_a_rather_long_name_for_a_service_that_handles_payments {
    pub mod and_a_submodule_that_handles_the_refunds_of_those_payments_too {
        use super::super::*;

        pub struct ARatherLongConsumerTypeName<E>(pub std::marker::PhantomData<E>);

        impl<E: Effect> ARatherLongConsumerTypeName<E> {
            #[idempotent(key = "msg.id", store = store)]
            pub async fn a_handler_with_a_long_name<S: Store>(
                store: &S,
                msg: &Msg,
                runs: &AtomicU32,
            ) -> Result<u32, AppError> {
                Ok(runs.fetch_add(1, Ordering::SeqCst) + 1)
            }
        }
    }
}

use a_module_with_a_rather_long_name_for_a_service_that_handles_payments::and_a_submodule_that_handles_the_refunds_of_those_payments_too::ARatherLongConsumerTypeName as Long;

async fn long_scopes_work_on<S: Store>(store: &S) {
    let runs = AtomicU32::new(0);
    let m = msg();
    assert_eq!(
        Long::<Charge>::a_handler_with_a_long_name(store, &m, &runs)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        Long::<Charge>::a_handler_with_a_long_name(store, &m, &runs)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        Long::<Notify>::a_handler_with_a_long_name(store, &m, &runs)
            .await
            .unwrap(),
        2
    );
    assert_eq!(
        Long::<Notify>::a_handler_with_a_long_name(store, &m, &runs)
            .await
            .unwrap(),
        2
    );
}

#[tokio::test]
async fn default_scopes_longer_than_the_column_are_shortened_uniquely_on_every_store() {
    long_scopes_work_on(&MemoryStore::new()).await;

    let pool = common::pg_pool(2).await;
    let table = common::unique("long_scopes");
    let pg = PgStore::builder(pool.clone()).table(&table).build().unwrap();
    pg.migrate().await.unwrap();
    long_scopes_work_on(&pg).await;
    let scopes: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!("SELECT scope FROM {table}")))
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(scopes.len(), 2);
    for scope in &scopes {
        assert!(scope.len() <= idempotent_runtime::MAX_SCOPE_BYTES, "{scope}");
        assert!(
            scope.starts_with('~') && scope.contains("a_handler_with_a_long_name"),
            "{scope}"
        );
    }
    common::drop_pg_table(&pool, &table).await;

    let mysql = common::mysql_pool(2).await;
    let table = common::unique("long_scopes");
    let my = idempotent_runtime::MySqlStore::builder(mysql.clone())
        .table(&table)
        .build()
        .unwrap();
    my.migrate().await.unwrap();
    long_scopes_work_on(&my).await;
    common::drop_mysql_table(&mysql, &table).await;

    let dir = tempfile::tempdir().unwrap();
    let lite = idempotent_runtime::SqliteStore::open(dir.path().join("long.db"))
        .await
        .unwrap();
    lite.migrate().await.unwrap();
    long_scopes_work_on(&lite).await;

    let client = idempotent_runtime::redis::Client::open(common::REDIS_URL).unwrap();
    let conn = client.get_connection_manager().await.unwrap();
    let prefix = format!("{}:", common::unique("long_scopes"));
    let redis = idempotent_runtime::RedisStore::builder(conn.clone())
        .prefix(prefix.clone())
        .build()
        .unwrap();
    long_scopes_work_on(&redis).await;
    let mut conn = conn;
    let keys: Vec<String> = idempotent_runtime::redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(keys.len(), 2);
    let () = idempotent_runtime::redis::cmd("DEL")
        .arg(keys)
        .query_async(&mut conn)
        .await
        .unwrap();
}
