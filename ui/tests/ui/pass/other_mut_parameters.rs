#![deny(warnings)]
//! `&mut` parameters that are not transactions stay parameters, whatever
//! their type: the probe for aliased transactions lets them through.

use std::collections::HashMap;

use idempotent_runtime::{MemoryStore, idempotent};

#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct AppError(#[from] idempotent_runtime::Error);

type Buffer<'a> = &'a mut Vec<u8>;

struct Msg {
    id: String,
}

#[idempotent(key = "msg.id", store = store)]
async fn handle<T: Send>(
    store: &MemoryStore,
    msg: &Msg,
    out: &mut Vec<u8>,
    buffer: Buffer<'_>,
    seen: &mut HashMap<String, u32>,
    generic: &mut T,
    (a, b): (u8, u8),
    r#type: &mut String,
) -> Result<(), AppError> {
    out.push(a);
    buffer.push(b);
    *seen.entry(msg.id.clone()).or_default() += 1;
    let _ = generic;
    r#type.push('x');
    Ok(())
}

fn main() {
    let _ = handle::<u8>;
}
