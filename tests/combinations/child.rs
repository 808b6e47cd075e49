//! Consumer SIGKILLs: a consumer of the configuration runs in a child
//! process (this test binary run again, its `checker_child_consumer`
//! entry) and is killed with SIGKILL at a drawn point of its work
//! (`config::KillPhase`), while the in-process consumers go on and drain
//! what it held.
//!
//! The child rebuilds the configuration's store, ledger and consumer from a
//! [`ChildSpec`] (JSON in `IDEMPOTENT_CHECKER_CHILD`) and attaches to the
//! parent's tables, queues and streams (it creates nothing). It tells the
//! parent what it does on its stdout, one line per event, each written
//! before its next step: `call ID`, `done ID`, `kill-point PHASE ID`,
//! `early ID`, `wrong ..`. What survives its death is what the checks
//! read: the effects, markers and outbox rows in the database (the
//! effects hash and the markers in Redis for the Redis store), the dead
//! letters and the unsettled messages on the broker, and the lines it wrote
//! (the "learnt too early" and replayed-result checks of its calls). Its
//! body faults are none (the parent's schedule fires each once, in the
//! parent); doomed, data-error and lone-outage messages fail in it as they
//! do everywhere. Its cache, if the configuration has one, dies with it
//! (the check of the cache's size is the parent's cache's).
//!
//! The child never outlives the run: the parent's handle kills it when
//! dropped (also on a panic), and the child exits when its stdin (a pipe
//! from the parent) closes, which the kernel does when the parent dies.

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idempotent_runtime::broker::pipeline::Broker;
use idempotent_runtime::broker::{CancellationToken, ConsumerBuilder, TRACING_TARGET};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::sync::mpsc;

use super::brokers::{Endpoints, Source};
use super::config::{BrokerKind, Config, KillPhase, Sigkill};
use super::db::{self, Attach, Opened};
use super::handlers::{self, AppError, Msg};
use super::run;

/// The environment variable that makes the test binary a child consumer.
pub const ENV: &str = "IDEMPOTENT_CHECKER_CHILD";
/// The test entry the child runs.
pub const ENTRY: &str = "checker_child_consumer";
/// What starts each of the child's lines to its parent.
const PREFIX: &str = "checker-child: ";
/// A child that was never killed exits by itself after this long.
const CHILD_LIFETIME: Duration = Duration::from_secs(300);

/// What a child needs to join a configuration's run.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ChildSpec {
    /// The configuration, its body faults, timed faults and kills left out
    /// (its settings those of the store's sessions when the child starts).
    pub config: Config,
    /// The run's unique name (tables, queues, streams).
    pub name: String,
    pub at: Endpoints,
    /// The SQLite file of the run.
    pub sqlite: Option<PathBuf>,
    /// The outbox's destination.
    pub sink: Option<String>,
    pub size_limit: bool,
    pub kill: Sigkill,
}

/// Tells the parent that the child reached its kill point (it then
/// hangs until the SIGKILL).
pub fn kill_point(phase: &str, id: &str) {
    say(&format!("kill-point {phase} {id}"));
}

fn say(line: &str) {
    println!("{PREFIX}{line}");
}

// ---- in the child ------------------------------------------------------------

struct ChildState {
    opened: Arc<Opened>,
    kill: Sigkill,
    value: bool,
    batched: bool,
}

async fn child_handle(st: Arc<ChildState>, msg: Msg) -> Result<(), AppError> {
    let ctx = st.opened.ledger.ctx();
    ctx.child_calls.fetch_add(1, Ordering::SeqCst);
    say(&format!("call {}", msg.id));
    let ran = AtomicBool::new(false);
    let answer = st.opened.ledger.apply(&msg, &ran, None).await;
    say(&format!("done {}", msg.id));
    let answer = answer?;
    let expected = st.value.then_some(msg.amount);
    if answer != expected {
        say(&format!("wrong {}: {answer:?} instead of {expected:?} (child)", msg.id));
    }
    if !ran.load(Ordering::SeqCst) && !st.batched && !st.opened.committed(&msg.id).await {
        say(&format!("early {}", msg.id));
    }
    if st.kill.phase == KillPhase::AfterOk && ctx.reach_kill_point(st.kill.after) {
        kill_point("after-ok", &msg.id);
        std::future::pending::<()>().await;
    }
    Ok(())
}

/// Hangs the thread that is about to acknowledge a committed batch's
/// deliveries (the library's "batch committed" event, emitted between the
/// commit and the acks), once the child reached its kill point.
struct BatchCommitKill {
    ctx: Arc<handlers::Ctx>,
    after: u64,
}

struct MessageField(String);

impl tracing::field::Visit for MessageField {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for BatchCommitKill {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let mut message = MessageField(String::new());
        event.record(&mut message);
        if message.0 == "batch committed" && self.ctx.reach_kill_point(self.after) {
            kill_point("after-batch-commit", "-");
            // The SIGKILL comes; nothing of this batch is acknowledged.
            loop {
                std::thread::park();
            }
        }
    }
}

async fn consume<B: Broker>(builder: ConsumerBuilder<B>, st: &Arc<ChildState>, spec: &ChildSpec) {
    let consumer = run::configure(builder, spec.size_limit, !spec.config.schedule.lone_outage.is_empty())
        .classify(handlers::classify)
        .build()
        .expect("consumer configuration");
    let st = Arc::clone(st);
    say("ready");
    let stopped = consumer
        .run(
            move |msg: Msg| {
                let st = Arc::clone(&st);
                child_handle(st, msg)
            },
            CancellationToken::new(),
        )
        .await;
    say(&format!("stopped {stopped:?}"));
}

/// Set once the child joined the run: from then on a panic ends it.
static STARTED: AtomicBool = AtomicBool::new(false);

/// Ends the child on a panic after it joined (its parent reports it);
/// before, a panic is a failed attempt to join, said by `join_retrying`.
fn exit_on_panic() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if STARTED.load(Ordering::SeqCst) {
            previous(info);
            say(&format!("panicked: {info}"));
            std::process::exit(101);
        }
    }));
}

/// Opens the store and the source, again for up to 60 s while they fail
/// (a restart of the private PostgreSQL or broker under way).
async fn join_retrying(spec: &ChildSpec) -> (Opened, Source) {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let spec = spec.clone();
        let joined = tokio::spawn(async move {
            let attach = Attach {
                sqlite: spec.sqlite.clone(),
            };
            let cfg = &spec.config;
            if !spec.at.cluster.is_empty() {
                let _ = db::CLUSTER_URLS.set(spec.at.cluster.clone());
            }
            let opened = db::open(cfg, &spec.name, spec.sink.clone(), &spec.at.pg, Some(&attach)).await;
            // Directly to the broker, also when the configuration's
            // in-process consumers go through the proxy
            // (`Config::through_proxy`): its cuts and stalls are theirs.
            let source = Source::attach(cfg.broker, &spec.name, &spec.at).await;
            (opened, source)
        })
        .await;
        match joined {
            Ok(joined) => return joined,
            Err(err) if Instant::now() < until => {
                say(&format!("joining failed ({err}), again"));
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(err) => {
                say(&format!("panicked: joining failed for 60 s ({err})"));
                std::process::exit(101);
            }
        }
    }
}

/// The child's life: joins the run, consumes until killed.
pub async fn child_main(spec: ChildSpec) {
    exit_on_panic();
    // Gone with the parent: its end of the stdin pipe closes.
    tokio::spawn(async {
        let mut stdin = tokio::io::stdin();
        let mut buf = [0u8; 64];
        while let Ok(n) = stdin.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
        std::process::exit(3);
    });
    tokio::spawn(async {
        tokio::time::sleep(CHILD_LIFETIME).await;
        std::process::exit(4);
    });
    // Joins, again while a server restarts (the store's or the broker's
    // connection refused); any later panic ends the child, which the
    // parent reports (a panic would otherwise leave it waiting on stdin).
    let (opened, source) = join_retrying(&spec).await;
    STARTED.store(true, Ordering::SeqCst);
    let cfg = &spec.config;
    let opened = Arc::new(opened);
    let ctx = Arc::clone(opened.ledger.ctx());
    match spec.kill.phase {
        KillPhase::MidBody => ctx.hang_body_after.store(spec.kill.after, Ordering::SeqCst),
        KillPhase::AfterBatchCommit => {
            use tracing_subscriber::layer::SubscriberExt;
            use tracing_subscriber::{Layer, filter};
            let layer = BatchCommitKill {
                ctx: Arc::clone(&ctx),
                after: spec.kill.after,
            }
            .with_filter(filter::Targets::new().with_target(TRACING_TARGET, tracing::Level::DEBUG));
            let subscriber = tracing_subscriber::registry().with(layer);
            tracing::subscriber::set_global_default(subscriber).expect("the child's only subscriber");
        }
        KillPhase::AfterOk | KillPhase::Timed(_) => {}
    }
    let st = Arc::new(ChildState {
        opened: Arc::clone(&opened),
        kill: spec.kill,
        value: cfg.value_result,
        batched: cfg.batch.is_some(),
    });
    let batch = opened.batch.clone();
    let prefetch = run::prefetch(cfg);
    match cfg.broker {
        BrokerKind::Rabbit => {
            let builder = run::with_batch(source.rabbit(prefetch as u16), &batch, cfg.batch)
                .concurrency(cfg.concurrency)
                .max_attempts(cfg.max_attempts);
            consume(builder, &st, &spec).await
        }
        BrokerKind::JetStream => {
            let builder = run::with_batch(source.jetstream(prefetch), &batch, cfg.batch)
                .concurrency(cfg.concurrency)
                .max_attempts(cfg.max_attempts);
            consume(builder, &st, &spec).await
        }
        BrokerKind::RedisStreams => {
            let builder = run::with_batch(source.streams(), &batch, cfg.batch)
                .concurrency(cfg.concurrency)
                .max_attempts(cfg.max_attempts);
            consume(builder, &st, &spec).await
        }
        BrokerKind::Kafka => {
            let builder = run::with_offsets(run::with_batch(source.kafka(), &batch, cfg.batch), &opened.offsets, cfg)
                .concurrency(cfg.concurrency)
                .max_attempts(cfg.max_attempts);
            consume(builder, &st, &spec).await
        }
    }
    // A consumer that stopped by itself waits for its SIGKILL too.
    std::future::pending::<()>().await
}

// ---- in the parent -----------------------------------------------------------

/// What a child said.
#[derive(Debug)]
pub enum Event {
    Ready,
    Call(String),
    Done(String),
    /// The phase as the child names it, and the message it holds (`-`
    /// for a batch).
    KillPoint(String, String),
    Early(String),
    Wrong(String),
    Other(String),
    /// Its stdout closed: it exited.
    Closed,
}

fn parse(line: &str) -> Option<Event> {
    let rest = line.strip_prefix(PREFIX)?;
    let (word, arg) = rest.split_once(' ').unwrap_or((rest, ""));
    Some(match word {
        "ready" => Event::Ready,
        "call" => Event::Call(arg.into()),
        "done" => Event::Done(arg.into()),
        "kill-point" => {
            let (phase, id) = arg.split_once(' ').unwrap_or((arg, "-"));
            Event::KillPoint(phase.into(), id.into())
        }
        "early" => Event::Early(arg.into()),
        "wrong" => Event::Wrong(arg.into()),
        _ => Event::Other(rest.into()),
    })
}

/// A child consumer, from the parent's side: SIGKILLed when dropped.
pub struct ChildConsumer {
    child: tokio::process::Child,
    events: mpsc::UnboundedReceiver<Event>,
    closed: bool,
    pub kill: Sigkill,
    pub spawned: Instant,
    /// Its handler calls so far.
    pub calls: u64,
    /// Messages its handlers hold (called, not returned).
    pub in_flight: HashSet<String>,
    /// When a timed kill is due.
    pub kill_at: Option<Instant>,
    /// The last line it wrote that is not an event (a panic, a retry).
    pub last_said: Option<String>,
}

impl ChildConsumer {
    pub fn spawn(spec: &ChildSpec) -> std::io::Result<ChildConsumer> {
        let exe = std::env::current_exe()?;
        let spec_json = serde_json::to_string(spec).map_err(std::io::Error::other)?;
        let mut child = tokio::process::Command::new(exe)
            .args([ENTRY, "--exact", "--nocapture", "--test-threads=1"])
            .env(ENV, spec_json)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()?;
        let stdout = child.stdout.take().ok_or_else(|| std::io::Error::other("no stdout"))?;
        let (tx, events) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(event) = parse(&line) {
                    let _ = tx.send(event);
                }
            }
            let _ = tx.send(Event::Closed);
        });
        Ok(ChildConsumer {
            child,
            events,
            closed: false,
            kill: spec.kill,
            spawned: Instant::now(),
            calls: 0,
            in_flight: HashSet::new(),
            kill_at: None,
            last_said: None,
        })
    }

    /// Its next event (pending forever once it closed).
    pub async fn next_event(&mut self) -> Event {
        if self.closed {
            return std::future::pending().await;
        }
        match self.events.recv().await {
            Some(Event::Closed) | None => {
                self.closed = true;
                Event::Closed
            }
            Some(event) => event,
        }
    }

    /// SIGKILL, and waits until it is gone (bounded).
    pub async fn sigkill(&mut self) -> Option<std::process::ExitStatus> {
        let _ = self.child.start_kill();
        tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .ok()
            .and_then(Result::ok)
    }

    /// Its exit status, if it exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

impl Drop for ChildConsumer {
    fn drop(&mut self) {
        // `kill_on_drop` does the same; said here so that it is seen.
        let _ = self.child.start_kill();
    }
}

/// The next event of the child, if there is one (pending otherwise).
pub async fn next_event(child: &mut Option<ChildConsumer>) -> Event {
    match child {
        Some(child) => child.next_event().await,
        None => std::future::pending().await,
    }
}

/// What the parent gives each of its children.
pub struct ChildPlan {
    pub config: Config,
    pub name: String,
    pub at: Endpoints,
    pub sqlite: Option<PathBuf>,
    pub sink: Option<String>,
    pub size_limit: bool,
}

impl ChildPlan {
    pub fn new(
        cfg: &Config,
        name: &str,
        at: &Endpoints,
        sqlite: Option<PathBuf>,
        sink: Option<String>,
        size_limit: bool,
    ) -> ChildPlan {
        let mut config = cfg.clone();
        config.schedule.body.clear();
        config.schedule.abort_after_commit.clear();
        config.schedule.timed.clear();
        config.schedule.relay.clear();
        config.schedule.sigkill.clear();
        ChildPlan {
            config,
            name: name.into(),
            at: at.clone(),
            sqlite,
            sink,
            size_limit,
        }
    }

    /// The spec of a child killed as `kill` says, its sessions with the
    /// settings the store's get now.
    pub fn spec(&self, kill: Sigkill, opened: &Opened) -> ChildSpec {
        let mut config = self.config.clone();
        config.settings.pg_sync_commit_off = opened.settings.pg_sync_commit_off.load(Ordering::SeqCst);
        config.settings.pg_isolation = opened.settings.pg_isolation.load(Ordering::SeqCst);
        config.settings.my_isolation = opened.settings.my_isolation.load(Ordering::SeqCst);
        ChildSpec {
            config,
            name: self.name.clone(),
            at: self.at.clone(),
            sqlite: self.sqlite.clone(),
            sink: self.sink.clone(),
            size_limit: self.size_limit,
            kill,
        }
    }
}

/// The name of where a kill landed, for the report: `phase` as the
/// child named it, in a batch or not.
pub fn landed(phase: &str, batched: bool) -> &'static str {
    match (phase, batched) {
        ("mid-body", false) => "mid-body",
        ("mid-body", true) => "mid-batch (in a body)",
        ("after-ok", false) => "after commit, before ack",
        ("after-ok", true) => "mid-batch (a member done)",
        ("after-batch-commit", _) => "after batch commit, before acks",
        _ => "other",
    }
}
