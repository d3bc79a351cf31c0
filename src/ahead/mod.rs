//! Decode ahead: right after mounting, decode the locked shards an engine will read, in the
//! order engines read them, within the passthrough memory budget and at low priority.
//!
//! Engines spend 5-60 s importing and starting before they open a weight file; a mount
//! started with the engine (or before it) uses that time, so the first open of each shard
//! finds its copy decoded, or partly decoded and urged to full priority. Shards are decoded
//! one at a time, each on all cores in the background (`SCHED_IDLE`, so the engine's own
//! start keeps the CPU). A shard that does not fit waits until copies are let go; a shard
//! opened meanwhile is left to its open. Copies decoded ahead and not opened yet are the
//! last let go when an open needs room (`OpenTable::make_room`), and are kept until opened:
//! their grace period starts at their last close.
//!
//! Check ahead ([`CheckAhead`]) is the same idea where there are no decoded copies (serving
//! through FUSE): a file under a manifest is hashed whole before its first byte is served,
//! so the files are hashed in the same order right after mounting, in the background, and
//! an open finds the verdict in instead of waiting for a hash of the whole file.
//!
//! Fetch ahead ([`FetchAhead`]) is the same idea through FUSE: the shards' sealed bytes are
//! brought in, in that order (remote parts kept until read, local pages into the page
//! cache), and decoded into the kernel's page cache of the mount on a second thread beside
//! the next fetch; under a manifest, each shard right after its check, or, remote, from the
//! bytes its check downloads (`ShardWalk::check_and_store`, in `check`).

mod check;
mod fetch;
mod store;

pub use check::{awaits_any_verdict, CheckAhead};
pub use fetch::{FetchAhead, FetchPlan};
pub use store::PageCache;

use std::cmp::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::fill::Fill;
use crate::view::{Content, Ino, View};

/// The index engines read to find the shards of a sharded checkpoint.
const INDEX: &str = "model.safetensors.index.json";
/// How often a shard waiting for room in the budget looks again.
const ROOM_POLL: Duration = Duration::from_secs(1);

/// The locked shards in the order engines load them: those the index lists, by name in
/// natural order (transformers and vLLM sort them so), then any other, by path.
pub fn order(view: &View) -> Vec<Ino> {
    let is_shard = |ino: Ino| {
        matches!(
            view.node(ino).map(|n| &n.content),
            Some(Content::Shard { .. })
        )
    };
    let mut listed: Vec<String> = index_files(view);
    listed.sort_by(|a, b| natural(a, b));
    listed.dedup();
    let mut out: Vec<Ino> = listed
        .iter()
        .filter_map(|name| view.resolve(name))
        .filter(|&ino| is_shard(ino))
        .collect();
    let mut rest: Vec<(String, Ino)> = view
        .file_paths()
        .into_iter()
        .filter(|(_, ino)| is_shard(*ino) && !out.contains(ino))
        .collect();
    rest.sort_by(|a, b| natural(&a.0, &b.0));
    out.extend(rest.into_iter().map(|(_, ino)| ino));
    out
}

/// The shard names of the root index's `weight_map`, or none.
fn index_files(view: &View) -> Vec<String> {
    let Some(ino) = view.resolve(INDEX) else {
        return Vec::new();
    };
    let Some(size) = view.node(ino).map(|n| n.attr.size as usize) else {
        return Vec::new();
    };
    let bytes = match view.read(ino, 0, size) {
        Ok(b) => b,
        Err(e) => {
            log::debug!("decode ahead: {INDEX} not read ({e}); shards in path order");
            return Vec::new();
        }
    };
    let doc: serde_json::Value = match serde_json::from_slice(&bytes) {
        Ok(d) => d,
        Err(e) => {
            log::debug!("decode ahead: {INDEX} is not JSON ({e}); shards in path order");
            return Vec::new();
        }
    };
    doc.get("weight_map")
        .and_then(|m| m.as_object())
        .map(|m| {
            m.values()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Compare names with runs of digits compared as numbers (`model-2` before `model-10`).
fn natural(a: &str, b: &str) -> Ordering {
    let (mut x, mut y) = (a.as_bytes(), b.as_bytes());
    loop {
        match (x.first(), y.first()) {
            (None, None) => return Ordering::Equal,
            (None, _) => return Ordering::Less,
            (_, None) => return Ordering::Greater,
            (Some(c), Some(d)) if c.is_ascii_digit() && d.is_ascii_digit() => {
                let (nx, ny) = (digits(x), digits(y));
                let (vx, vy) = (&x[..nx], &y[..ny]);
                let (tx, ty) = (trim_zeros(vx), trim_zeros(vy));
                let ord = tx.len().cmp(&ty.len()).then(tx.cmp(ty));
                if ord != Ordering::Equal {
                    return ord;
                }
                x = &x[nx..];
                y = &y[ny..];
            }
            (Some(c), Some(d)) if c != d => return c.cmp(d),
            _ => {
                x = &x[1..];
                y = &y[1..];
            }
        }
    }
}

fn digits(s: &[u8]) -> usize {
    s.iter().take_while(|c| c.is_ascii_digit()).count()
}

fn trim_zeros(s: &[u8]) -> &[u8] {
    let z = s.iter().take_while(|&&c| c == b'0').count();
    &s[z..]
}

/// What a request to decode a file ahead did.
pub enum Ahead {
    Started(Arc<Fill>),
    /// Opened already, or decoded already.
    Skipped,
    /// The budget has no room for it now.
    NoRoom,
}

/// Start decoding ahead on a thread of its own: `decode(ino, rank)` asks for one shard's
/// copy (see `OpenTable::decode_ahead`); `budget()` is the passthrough memory while
/// passthrough is on, `None` once it is off.
pub fn start(
    view: Arc<View>,
    budget: impl Fn() -> Option<u64> + Send + 'static,
    decode: impl Fn(Ino, usize) -> Ahead + Send + 'static,
) {
    let run = move || run(&view, budget, decode);
    spawn(
        "kllm-ahead",
        run,
        "decode ahead",
        "shards are decoded on their first open",
    );
}

/// Start `run` on a thread named `name`; whether it started. If not, say that there is no
/// `what` and what happens instead (`then`).
fn spawn(name: &str, run: impl FnOnce() + Send + 'static, what: &str, then: &str) -> bool {
    match std::thread::Builder::new().name(name.into()).spawn(run) {
        Ok(_) => true,
        Err(e) => {
            log::warn!("no {what} ({e}): {then}");
            false
        }
    }
}

fn run(view: &View, budget: impl Fn() -> Option<u64>, decode: impl Fn(Ino, usize) -> Ahead) {
    let order = order(view);
    log::debug!("decode ahead: {} shards", order.len());
    for (rank, &ino) in order.iter().enumerate() {
        loop {
            let Some(budget) = budget() else {
                return;
            };
            if view.node(ino).map_or(0, |n| n.attr.size) > budget {
                break;
            }
            match decode(ino, rank) {
                Ahead::Started(fill) => {
                    fill.wait_done();
                    break;
                }
                Ahead::Skipped => break,
                Ahead::NoRoom => std::thread::sleep(ROOM_POLL),
            }
        }
    }
    log::debug!("decode ahead: done");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn natural_order_of_shard_names() {
        let mut names = vec![
            "model-10-of-12.safetensors",
            "model-2-of-12.safetensors",
            "model-00001-of-00012.safetensors",
            "a/model.safetensors",
            "model-1-of-12.safetensors",
        ];
        names.sort_by(|a, b| natural(a, b));
        assert_eq!(
            names,
            [
                "a/model.safetensors",
                "model-00001-of-00012.safetensors",
                "model-1-of-12.safetensors",
                "model-2-of-12.safetensors",
                "model-10-of-12.safetensors",
            ]
        );
    }
}
