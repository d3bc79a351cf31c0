//! Cutting a byte range at a grid of fixed-size blocks: the blocks it covers whole, and
//! the pieces of blocks it cuts at either end. The cache cuts reads at its blocks, the
//! decoder cuts a tensor's bytes at its units; both use [`cut`].

use std::ops::Range;

/// The part of a range inside one block it does not cover whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// The block's index.
    pub block: u64,
    /// The range's bytes in it (absolute offsets).
    pub bytes: Range<u64>,
}

/// `[start, end)` on a grid of blocks: an optional cut piece, a run of whole blocks, an
/// optional cut piece, in that order, covering the range exactly. A range inside one block
/// that it does not cover is a `head` alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cut {
    pub head: Option<Piece>,
    /// Indices of the blocks covered whole.
    pub whole: Range<u64>,
    pub tail: Option<Piece>,
}

/// Cut `[start, end)` at multiples of `size`, in a space of `total` bytes whose last block
/// may be short: a range reaching `total` covers that block whole. `end <= total`.
pub fn cut(start: u64, end: u64, size: u64, total: u64) -> Cut {
    debug_assert!(size > 0 && end <= total);
    if start >= end {
        return Cut {
            head: None,
            whole: 0..0,
            tail: None,
        };
    }
    let block_end = |i: u64| ((i + 1) * size).min(total);
    let first = start / size;
    let last = (end - 1) / size;
    let head_cut = !start.is_multiple_of(size);
    let tail_cut = end != block_end(last);
    if first == last {
        if head_cut || tail_cut {
            return Cut {
                head: Some(Piece {
                    block: first,
                    bytes: start..end,
                }),
                whole: first..first,
                tail: None,
            };
        }
        return Cut {
            head: None,
            whole: first..first + 1,
            tail: None,
        };
    }
    let head = head_cut.then(|| Piece {
        block: first,
        bytes: start..block_end(first),
    });
    let tail = tail_cut.then(|| Piece {
        block: last,
        bytes: last * size..end,
    });
    Cut {
        whole: first + head_cut as u64..last + 1 - tail_cut as u64,
        head,
        tail,
    }
}

impl Cut {
    /// The bytes of the whole blocks (absolute offsets), given the cut's `size` and `total`.
    pub fn whole_bytes(&self, size: u64, total: u64) -> Range<u64> {
        if self.whole.is_empty() {
            return 0..0;
        }
        self.whole.start * size..(self.whole.end * size).min(total)
    }
}

/// The bytes two ranges share, empty when none.
pub fn overlap(a: Range<u64>, b: Range<u64>) -> Range<u64> {
    let start = a.start.max(b.start);
    start..a.end.min(b.end).max(start)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn examples() {
        // Inside one block.
        let c = cut(3, 5, 8, 100);
        assert_eq!(
            (c.head, c.whole.is_empty(), c.tail),
            (
                Some(Piece {
                    block: 0,
                    bytes: 3..5
                }),
                true,
                None
            )
        );
        // Cut at both ends around two whole blocks.
        let c = cut(3, 29, 8, 100);
        assert_eq!(c.head.unwrap().bytes, 3..8);
        assert_eq!(c.whole, 1..3);
        assert_eq!(
            c.tail.unwrap(),
            Piece {
                block: 3,
                bytes: 24..29
            }
        );
        // A short last block read to the end is whole.
        let c = cut(16, 21, 8, 21);
        assert_eq!((&c.head, &c.whole, &c.tail), (&None, &(2..3), &None));
        assert_eq!(c.whole_bytes(8, 21), 16..21);
        assert_eq!(overlap(0..4, 6..9), 6..6);
        assert_eq!(overlap(0..7, 6..9), 6..7);
    }

    proptest! {
        #[test]
        fn pieces_cover_the_range_in_order(
            size in 1u64..64,
            total in 0u64..1000,
            a in 0u64..1000,
            b in 0u64..1000,
        ) {
            let (start, end) = (a.min(b).min(total), a.max(b).min(total));
            let c = cut(start, end, size, total);
            let block = |i: u64| i * size..((i + 1) * size).min(total);
            let mut spans = Vec::new();
            if let Some(h) = &c.head {
                // A cut piece lies in its block and does not cover it.
                prop_assert!(h.bytes.start >= block(h.block).start && h.bytes.end <= block(h.block).end);
                prop_assert!(h.bytes != block(h.block));
                spans.push(h.bytes.clone());
            }
            if !c.whole.is_empty() {
                prop_assert_eq!(c.whole_bytes(size, total).start, block(c.whole.start).start);
                prop_assert_eq!(c.whole_bytes(size, total).end, block(c.whole.end - 1).end);
                spans.push(c.whole_bytes(size, total));
            }
            if let Some(t) = &c.tail {
                prop_assert!(t.bytes.start == block(t.block).start && t.bytes.end < block(t.block).end);
                spans.push(t.bytes.clone());
            }
            // Adjacent, non-empty, from start to end.
            let mut at = start;
            for s in &spans {
                prop_assert_eq!(s.start, at);
                prop_assert!(s.end > s.start);
                at = s.end;
            }
            prop_assert_eq!(at, end);
        }

        #[test]
        fn overlap_is_the_intersection(a in 0u64..50, b in 0u64..50, c in 0u64..50, d in 0u64..50) {
            let (x, y) = (a.min(b)..a.max(b), c.min(d)..c.max(d));
            let o = overlap(x.clone(), y.clone());
            for i in 0..50 {
                prop_assert_eq!(o.contains(&i), x.contains(&i) && y.contains(&i));
            }
        }
    }
}
