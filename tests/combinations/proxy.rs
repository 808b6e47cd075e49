//! A TCP proxy between the in-process consumers and their broker (issue
//! 43, `conn-cut`, `conn-stall`, `settle-cut`): it forwards every
//! connection it accepts to the broker, and can cut them all at once (the
//! consumers see their connections closed and connect again, through it)
//! or stall them (no byte goes through in either direction for a while, no
//! reset, the sockets kept open; a connection accepted meanwhile waits too).
//! The checker's own connections (its reads of the backlog and the dead
//! letters, its publishes) stay direct, so that a stall never holds up the
//! checks.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotent_runtime::broker::CancellationToken;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;

use super::config::Config;

/// What the connections share: the token of the current generation (a cut
/// cancels it and starts a new one) and the end of the current stall.
struct State {
    target: String,
    cut: Mutex<CancellationToken>,
    /// Until when nothing goes through (`None`: forwarding).
    stall: watch::Sender<Option<Instant>>,
    /// Connections accepted so far.
    accepted: AtomicU64,
    /// What the clients send is dropped (until the next cut); what the
    /// broker sends goes on.
    mute_up: AtomicBool,
}

impl State {
    fn generation(&self) -> CancellationToken {
        self.cut.lock().unwrap().clone()
    }

    /// Waits until no stall is under way; `false` if the connection was
    /// cut meanwhile.
    async fn unstalled(&self, cut: &CancellationToken) -> bool {
        let mut changes = self.stall.subscribe();
        loop {
            let until = *changes.borrow_and_update();
            match until {
                Some(until) if until > Instant::now() => {
                    tokio::select! {
                        () = cut.cancelled() => return false,
                        () = tokio::time::sleep_until(until) => {}
                        changed = changes.changed() => {
                            if changed.is_err() {
                                return true;
                            }
                        }
                    }
                }
                _ => return !cut.is_cancelled(),
            }
        }
    }
}

/// A proxy listening on 127.0.0.1 (a port of its own) in front of
/// `target`; stopped, and every connection closed, when dropped.
pub struct Proxy {
    addr: SocketAddr,
    state: Arc<State>,
    stop: CancellationToken,
}

impl Proxy {
    /// Listens on `127.0.0.1:0` and forwards to `target` (`host:port`).
    pub async fn start(target: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("the proxy's listener");
        let addr = listener.local_addr().expect("the proxy's address");
        let (stall, _) = watch::channel(None);
        let state = Arc::new(State {
            target: target.to_owned(),
            cut: Mutex::new(CancellationToken::new()),
            stall,
            accepted: AtomicU64::new(0),
            mute_up: AtomicBool::new(false),
        });
        let stop = CancellationToken::new();
        tokio::spawn(accept_loop(listener, Arc::clone(&state), stop.clone()));
        Proxy { addr, state, stop }
    }

    /// `127.0.0.1:port`, where the consumers connect.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// Closes every connection it holds now; connections accepted after
    /// it are forwarded (once a stall under way ends).
    pub fn cut(&self) {
        let mut cut = self.state.cut.lock().unwrap();
        cut.cancel();
        *cut = CancellationToken::new();
        self.state.mute_up.store(false, Ordering::SeqCst);
    }

    /// Drops every byte the clients send from now until the next cut (the
    /// broker's answers still go through): an ack or a publish sent meanwhile
    /// never arrives.
    pub fn mute_clients(&self) {
        self.state.mute_up.store(true, Ordering::SeqCst);
    }

    /// Forwards nothing, in either direction and on every connection (the
    /// ones it holds and the ones it accepts meanwhile), for `d` from now
    /// (or until a stall under way ends, if later): no reset, no answer.
    pub fn stall(&self, d: Duration) {
        let until = Instant::now() + d;
        self.state
            .stall
            .send_modify(|current| *current = Some(current.map_or(until, |c| c.max(until))));
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.state.accepted.load(Ordering::SeqCst)
    }

    /// Ends a stall under way: what was held goes through.
    pub fn unstall(&self) {
        self.state.stall.send_replace(None);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
        self.state.cut.lock().unwrap().cancel();
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<State>, stop: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((client, _)) => {
                state.accepted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(forward(client, Arc::clone(&state)));
            }
            // Out of descriptors or a connection reset before it was
            // accepted: the listener goes on.
            Err(err) => {
                eprintln!("checker: the proxy's accept failed ({err}), going on");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// One connection: held while a stall is under way, then connected to the
/// target and pumped both ways until a side closes or a cut.
async fn forward(client: TcpStream, state: Arc<State>) {
    let cut = state.generation();
    if !state.unstalled(&cut).await {
        return;
    }
    let server = tokio::select! {
        () = cut.cancelled() => return,
        server = TcpStream::connect(&state.target) => match server {
            Ok(server) => server,
            // The broker is not there: the client sees its connection closed.
            Err(_) => return,
        },
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = pump(client_read, server_write, Arc::clone(&state), cut.clone(), true);
    let down = pump(server_read, client_write, state, cut, false);
    tokio::join!(up, down);
}

/// Forwards `from` to `to` until `from` closes, a write fails or a cut.
/// What it read during a stall (data or the end of the stream) goes on
/// only once the stall is over.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    state: Arc<State>,
    cut: CancellationToken,
    up: bool,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let read = tokio::select! {
            () = cut.cancelled() => return,
            read = from.read(&mut buf) => read,
        };
        if !state.unstalled(&cut).await {
            return;
        }
        let n = match read {
            // The peer closed (or reset): pass the close on.
            Ok(0) | Err(_) => {
                let _ = to.shutdown().await;
                return;
            }
            Ok(n) => n,
        };
        if up && state.mute_up.load(Ordering::SeqCst) {
            continue;
        }
        let written = tokio::select! {
            () = cut.cancelled() => return,
            written = to.write_all(&buf[..n]) => written,
        };
        if written.is_err() {
            return;
        }
    }
}

/// `host:port` of a URL (`scheme://user:pass@host:port/path`) or of a bare
/// `host:port`.
pub fn host_port(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, rest)| rest);
    rest.split('/').next().unwrap_or(rest)
}

/// `url` with its `host:port` replaced by `addr`.
pub fn via(url: &str, addr: &str) -> String {
    url.replacen(host_port(url), addr, 1)
}

/// The connection faults of a run through the proxy: the proxy, and the
/// settle cuts (`Config::settle_cut`): when a message fails on the run
/// that gets it dead-lettered, the proxy drops what the consumers send
/// from a drawn few milliseconds later (while its dead letter is
/// published and the original settled) and cuts every connection 200 ms
/// after.
pub struct ConnFaults {
    pub proxy: Proxy,
    max_attempts: u32,
    /// Messages that fail on each of their first `max_attempts` runs
    /// (doomed, relapses, lone outages) and messages refused at once (data
    /// errors; any attempt).
    exhausting: HashSet<String>,
    refused: HashSet<String>,
    /// The settle cuts' delays (ms) still to fire, in order; empty
    /// without settle cuts.
    delays: Mutex<Vec<u64>>,
    pub settle_cuts: Arc<AtomicU64>,
}

impl ConnFaults {
    /// The proxy of `cfg`'s consumers, in front of `target`.
    pub async fn start(cfg: &Config, target: &str) -> ConnFaults {
        let s = &cfg.schedule;
        ConnFaults {
            proxy: Proxy::start(target).await,
            max_attempts: cfg.max_attempts,
            exhausting: s
                .doomed
                .iter()
                .chain(&s.relapse)
                .chain(&s.lone_outage)
                .cloned()
                .collect(),
            refused: s.data_error.iter().cloned().collect(),
            delays: Mutex::new(if cfg.settle_cut {
                s.settle_cut_ms.iter().rev().copied().collect()
            } else {
                Vec::new()
            }),
            settle_cuts: Arc::default(),
        }
    }

    /// A handler of `id` failed on its `attempt`-th delivery: if that run
    /// gets it dead-lettered, the connections are cut a drawn moment
    /// later (while settlements remain).
    pub fn after_failure(self: &Arc<Self>, id: &str, attempt: u32) {
        let last = (attempt >= self.max_attempts && self.exhausting.contains(id)) || self.refused.contains(id);
        if !last {
            return;
        }
        let Some(delay) = self.delays.lock().unwrap().pop() else {
            return;
        };
        let this = Arc::clone(self);
        tokio::spawn(async move {
            if delay > 0 {
                tokio::time::sleep(Duration::from_millis(delay)).await;
            }
            this.proxy.mute_clients();
            tokio::time::sleep(Duration::from_millis(200)).await;
            this.proxy.cut();
            this.settle_cuts.fetch_add(1, Ordering::SeqCst);
        });
    }
}
