//! The in-process `MemoryStore`: what the macro and a store cost when no I/O
//! hides them. The effect is an atomic counter.

use std::sync::atomic::{AtomicU64, Ordering};

use idempotent_runtime::store::Store;
use idempotent_runtime::{Error, idempotent};

use crate::harness::{BoxError, Outcome, Variant};
use crate::pg::Msg;

/// No idempotency: the effect only.
#[derive(Default)]
pub struct Bare {
    effects: AtomicU64,
}

impl Bare {
    async fn handle(&self, msg: &Msg) -> Result<(), Error> {
        msg.ran.store(true, Ordering::Relaxed);
        self.effects.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl Variant for Bare {
    async fn deliver(&self, key: String) -> Result<Outcome, BoxError> {
        let msg = Msg::new(key);
        self.handle(&msg).await?;
        Ok(msg.outcome())
    }
}

pub struct Macro<S> {
    pub store: S,
    effects: AtomicU64,
}

impl<S: Store + 'static> Macro<S> {
    pub fn new(store: S) -> Self {
        Macro {
            store,
            effects: AtomicU64::new(0),
        }
    }

    #[idempotent(key = "msg.key", store = self.store, scope = "handle")]
    async fn handle(&self, msg: &Msg) -> Result<(), Error> {
        msg.ran.store(true, Ordering::Relaxed);
        self.effects.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl<S: Store + 'static> Variant for Macro<S> {
    async fn deliver(&self, key: String) -> Result<Outcome, BoxError> {
        let msg = Msg::new(key);
        match self.handle(&msg).await {
            Ok(()) => Ok(msg.outcome()),
            Err(Error::InProgress { .. }) => Ok(Outcome::Busy),
            Err(e) => Err(e.into()),
        }
    }
}

/// What a handler that returns a value stores and replays: a receipt of a
/// few fields (strings, a float, a list, an option), the usual shape of a
/// result that is not `()`.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
pub struct Receipt {
    order_id: String,
    amount: f64,
    lines: Vec<u32>,
    note: Option<String>,
}

/// [`Macro`] with a [`Receipt`] for result: the same call, plus encoding
/// the result before the commit (and checking that it reads back) and
/// decoding it for each duplicate.
pub struct MacroValue<S> {
    pub store: S,
    effects: AtomicU64,
}

impl<S: Store + 'static> MacroValue<S> {
    pub fn new(store: S) -> Self {
        MacroValue {
            store,
            effects: AtomicU64::new(0),
        }
    }

    #[idempotent(key = "msg.key", store = self.store, scope = "handle_value")]
    async fn handle(&self, msg: &Msg) -> Result<Receipt, Error> {
        msg.ran.store(true, Ordering::Relaxed);
        let n = self.effects.fetch_add(1, Ordering::Relaxed);
        Ok(Receipt {
            order_id: msg.key.clone(),
            amount: n as f64 * 0.1,
            lines: vec![1, 2, 3],
            note: None,
        })
    }
}

impl<S: Store + 'static> Variant for MacroValue<S> {
    async fn deliver(&self, key: String) -> Result<Outcome, BoxError> {
        let msg = Msg::new(key);
        match self.handle(&msg).await {
            Ok(receipt) if receipt.order_id == msg.key => Ok(msg.outcome()),
            Ok(_) => Err("a replay of another key's receipt".into()),
            Err(Error::InProgress { .. }) => Ok(Outcome::Busy),
            Err(e) => Err(e.into()),
        }
    }
}
