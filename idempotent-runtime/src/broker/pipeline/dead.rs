//! The consumer's memory of the messages it dead-lettered: a redelivery of
//! one of them (its removal lost with the connection, refused, or not
//! known to have happened) is settled without running its handler again.
//!
//! A dead letter is stored in one step and the delivery removed in another
//! (an ack, a term, an offset); no broker makes the two one transaction
//! with the handler's database. Between them the message is both in the
//! dead-letter destination and still at the broker: without this memory,
//! its redelivery would run the handler, which could now succeed and
//! commit an effect for a message already dead-lettered.
//!
//! One memory for the process, by source and identity: a consumer that
//! is stopped or aborted and run again in the same process (a supervisor
//! restarting its task) still recognises what it dead-lettered. What it
//! does not cover is a process that dies between the two steps.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{LazyLock, Mutex};

use super::traits::Delivery;
use crate::broker::stats::DeadKind;

/// How many dead-lettered messages a consumer remembers (the oldest are
/// forgotten first). A redelivery comes within the broker's redelivery
/// delay (a reconnect, an `ack_wait`), long before this many later dead
/// letters; an entry is an identity and, when its publish's outcome is not
/// known, its letter.
pub(super) const REMEMBERED: usize = 10_000;

/// The letter to publish again on a redelivery, when the publish's outcome
/// was not known.
#[derive(Clone)]
pub(super) struct Unsure {
    pub(super) kind: DeadKind,
    pub(super) reason: String,
    pub(super) attempts: u32,
}

/// What the consumer knows of a dead-lettered message.
#[derive(Clone)]
pub(super) enum Dead {
    /// Its dead letter is stored: remove it.
    Stored,
    /// Its dead letter may be stored: publish it again (safe, see
    /// [`Delivery::dead_letter`](super::traits::Delivery::dead_letter)),
    /// then remove it.
    Unsure(Unsure),
}

/// The memory (see the module).
#[derive(Default)]
pub(super) struct DeadLettered {
    /// Something is remembered: the path of every other delivery looks at
    /// this flag only.
    any: AtomicBool,
    entries: Mutex<Entries>,
}

#[derive(Default)]
struct Entries {
    by_identity: HashMap<String, Dead>,
    order: VecDeque<String>,
}

/// The process's memory.
static PROCESS: LazyLock<DeadLettered> = LazyLock::new(DeadLettered::default);

impl DeadLettered {
    /// The memory every consumer of the process shares.
    pub(super) fn process() -> &'static DeadLettered {
        &PROCESS
    }

    /// Remembers `identity` of `source` as `dead` (a later call for the
    /// same message replaces what an earlier one said).
    pub(super) fn remember(&self, source: &str, identity: &str, dead: Dead) {
        let key = key(source, identity);
        let Ok(mut entries) = self.entries.lock() else {
            return;
        };
        if entries.by_identity.insert(key.clone(), dead).is_none() {
            entries.order.push_back(key);
        }
        while entries.order.len() > REMEMBERED {
            if let Some(oldest) = entries.order.pop_front() {
                entries.by_identity.remove(&oldest);
            }
        }
        self.any.store(true, Ordering::Release);
    }

    /// Forgets `identity` of `source` (its dead letter was refused: nothing
    /// is stored).
    pub(super) fn forget(&self, source: &str, identity: &str) {
        let key = key(source, identity);
        if let Ok(mut entries) = self.entries.lock()
            && entries.by_identity.remove(&key).is_some()
        {
            // Rare (a refused dead letter): a scan of the order is fine.
            entries.order.retain(|k| *k != key);
        }
    }

    /// What is remembered of `delivery`'s message, consumed from `source`
    /// (its identity is asked for only once something is remembered).
    pub(super) fn recall<Dl: Delivery>(&self, source: &str, delivery: &Dl) -> Option<Dead> {
        if !self.any.load(Ordering::Acquire) || delivery.first_delivery() {
            return None;
        }
        self.recall_identity(source, &delivery.identity()?)
    }

    /// What is remembered of `identity` from `source`.
    pub(super) fn recall_identity(&self, source: &str, identity: &str) -> Option<Dead> {
        self.entries
            .lock()
            .ok()?
            .by_identity
            .get(&key(source, identity))
            .cloned()
    }
}

/// The entry of `identity` from `source` (a source's name holds no NUL).
fn key(source: &str, identity: &str) -> String {
    format!("{source}\0{identity}")
}

#[cfg(test)]
mod tests {
    use super::{Dead, DeadLettered, REMEMBERED};

    #[test]
    fn remembers_the_latest_word_on_each_identity_and_forgets_the_oldest_past_its_bound() {
        let dead = DeadLettered::default();
        assert!(dead.recall_identity("q", "a").is_none());
        dead.remember(
            "q",
            "a",
            Dead::Unsure(super::Unsure {
                kind: crate::broker::stats::DeadKind::Exhausted,
                reason: "boom".into(),
                attempts: 1,
            }),
        );
        assert!(matches!(dead.recall_identity("q", "a"), Some(Dead::Unsure(_))));
        dead.remember("q", "a", Dead::Stored);
        assert!(dead.recall_identity("other", "a").is_none(), "another source's message");
        assert!(matches!(dead.recall_identity("q", "a"), Some(Dead::Stored)));
        for i in 0..REMEMBERED {
            dead.remember("q", &i.to_string(), Dead::Stored);
        }
        assert!(dead.recall_identity("q", "a").is_none(), "the oldest is forgotten");
        assert!(dead.recall_identity("q", "0").is_some());
        assert!(dead.recall_identity("q", &(REMEMBERED - 1).to_string()).is_some());
        dead.forget("q", "0");
        assert!(dead.recall_identity("q", "0").is_none(), "forgotten");
        assert!(dead.recall_identity("q", "1").is_some(), "only it");
        // Its place in the order went with it: remembered again, it is
        // the newest, and one more entry evicts "1", not it.
        dead.remember("q", "0", Dead::Stored);
        dead.remember("q", "new", Dead::Stored);
        assert!(dead.recall_identity("q", "0").is_some());
        assert!(dead.recall_identity("q", "1").is_none());
    }
}
