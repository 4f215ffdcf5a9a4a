//! How the pager and pagesim batch their I/O: runs of adjacent items become
//! one request, and an eviction's writes are joined across short gaps.

use std::ops::Range;

use crate::ledger::{PlanBlock, NO_LOC};

/// Splits `items` into maximal runs in which `joins(previous, next)` holds
/// for every neighbouring pair: the one loop behind every batched request.
pub fn runs<'a, T>(
    items: &'a [T],
    joins: impl Fn(&T, &T) -> bool + 'a,
) -> impl Iterator<Item = Range<usize>> + 'a {
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= items.len() {
            return None;
        }
        let mut end = start + 1;
        while end < items.len() && joins(&items[end - 1], &items[end]) {
            end += 1;
        }
        let run = start..end;
        start = end;
        Some(run)
    })
}

/// `0..len` in chunks of `size`: the one holding index `lead` first, then
/// the others in order (a wake's first block, see the pager's prefetch).
pub fn lead_first(
    len: usize,
    size: usize,
    lead: Option<usize>,
) -> impl Iterator<Item = Range<usize>> {
    let first = lead.filter(|&i| i < len).map(|i| i / size);
    first
        .into_iter()
        .chain((0..len.div_ceil(size)).filter(move |&k| Some(k) != first))
        .map(move |k| k * size..((k + 1) * size).min(len))
}

/// Largest run of unchanged blocks an eviction rewrites to join two writes
/// (see [`cluster_writes`]): on the modeled disks one positioning (5-13 ms)
/// costs what moving 200-500 KiB does.
pub const WRITE_CLUSTER_GAP_BYTES: u64 = 256 << 10;

/// Joins an eviction's writes across short gaps: unchanged blocks whose swap
/// copy lies exactly between two blocks to be written, contiguous on swap, are
/// written too (with their own content, which is their swap copy's). With
/// small blocks the changed blocks of a working set are scattered, and each
/// would be a write paying its own positioning; joined, the VM goes out in
/// one sequential write, as Denali's model has it. Gaps up to
/// [`WRITE_CLUSTER_GAP_BYTES`] are joined. Call before [`write_runs`].
pub fn cluster_writes(victims: &mut [PlanBlock], block_bytes: u64) {
    let offset = |p: &PlanBlock, at: u64| p.old_loc == at && (p.loc == NO_LOC || p.loc == at);
    let mut last: Option<usize> = None;
    for i in 0..victims.len() {
        if !victims[i].dirty || victims[i].loc == NO_LOC {
            continue;
        }
        if let Some(w) = last.filter(|&w| i > w + 1) {
            let base = victims[w].loc;
            let gap = (i - w - 1) as u64;
            if gap * block_bytes <= WRITE_CLUSTER_GAP_BYTES
                && victims[i].loc == base + (gap + 1) * block_bytes
                && (w + 1..i).all(|k| offset(&victims[k], base + (k - w) as u64 * block_bytes))
            {
                for p in &mut victims[w + 1..i] {
                    p.dirty = true;
                    p.loc = p.old_loc;
                }
            }
        }
        last = Some(i);
    }
}

/// Groups the swap writes of an eviction plan: the ranges of `victims` that
/// are dirty and contiguous on swap, each one write. The pager and pagesim
/// batch writes alike through this.
pub fn write_runs(
    victims: &[PlanBlock],
    block_bytes: u64,
) -> impl Iterator<Item = Range<usize>> + '_ {
    runs(victims, move |a, b| {
        a.dirty && b.dirty && b.loc == a.loc + block_bytes
    })
    .filter(|run| victims[run.start].dirty)
}

/// Groups the swap reads of a fault-in plan: `order` receives the indices of
/// blocks with a swap copy sorted by swap offset, `runs` ranges of `order`
/// whose copies are contiguous on swap. Each run is one read, whatever the
/// blocks' order in RAM (a working set written back in several batches
/// lies in several extents; adjacent ones are read together).
pub fn read_runs(
    plan: &[PlanBlock],
    block_bytes: u64,
    order: &mut Vec<usize>,
    runs: &mut Vec<(usize, usize)>,
) {
    order.clear();
    runs.clear();
    order.extend((0..plan.len()).filter(|&i| plan[i].loc != NO_LOC));
    order.sort_unstable_by_key(|&i| plan[i].loc);
    runs.extend(
        self::runs(order, |&a, &b| plan[b].loc == plan[a].loc + block_bytes)
            .map(|run| (run.start, run.end)),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_split_where_neighbours_do_not_join() {
        let items = [1, 2, 3, 7, 8, 10];
        let got: Vec<_> = runs(&items, |a, b| b == &(a + 1)).collect();
        assert_eq!(got, vec![0..3, 3..5, 5..6]);
        assert_eq!(runs(&[] as &[u32], |_, _| true).count(), 0);
    }

    #[test]
    fn lead_first_puts_the_chunk_with_the_lead_first_and_keeps_every_index_once() {
        let got: Vec<_> = lead_first(10, 4, Some(5)).collect();
        assert_eq!(got, vec![4..8, 0..4, 8..10]);
        let got: Vec<_> = lead_first(10, 4, Some(9)).collect();
        assert_eq!(got, vec![8..10, 0..4, 4..8]);
        let in_order = vec![0..4, 4..8, 8..10];
        assert_eq!(lead_first(10, 4, None).collect::<Vec<_>>(), in_order);
        assert_eq!(lead_first(10, 4, Some(10)).collect::<Vec<_>>(), in_order);
        assert_eq!(lead_first(0, 4, None).count(), 0);
    }

    fn victim(loc: u64, dirty: bool) -> PlanBlock {
        PlanBlock {
            vm: 0,
            block: 0,
            loc,
            from_template: false,
            dirty,
            old_loc: NO_LOC,
            sum: 0,
            hash: false,
        }
    }

    #[test]
    fn dirty_victims_contiguous_on_swap_are_one_write() {
        let bs = 4096;
        let victims = [
            victim(0, true),
            victim(bs, true),
            victim(NO_LOC, false),
            victim(5 * bs, true),
            victim(9 * bs, true),
            victim(10 * bs, true),
            victim(NO_LOC, false),
        ];
        let runs: Vec<_> = write_runs(&victims, bs).collect();
        assert_eq!(runs, vec![0..2, 3..4, 4..6]);
        assert_eq!(write_runs(&[victim(NO_LOC, false)], bs).count(), 0);
    }

    fn unchanged(old_loc: u64) -> PlanBlock {
        PlanBlock {
            old_loc,
            ..victim(NO_LOC, false)
        }
    }

    #[test]
    fn short_gaps_of_unchanged_blocks_are_rewritten_to_join_writes() {
        let bs = 4096;
        // Written blocks at 0 and 4 with three unchanged ones in between, in place: one write.
        let mut victims = [
            victim(0, true),
            unchanged(bs),
            unchanged(2 * bs),
            unchanged(3 * bs),
            victim(4 * bs, true),
        ];
        cluster_writes(&mut victims, bs);
        assert!(victims.iter().all(|p| p.dirty));
        assert_eq!(
            victims[2].loc,
            2 * bs,
            "an unchanged block is rewritten where its copy is"
        );
        assert_eq!(write_runs(&victims, bs).collect::<Vec<_>>(), vec![0..5]);
        // Not joined: a block without a swap copy in the gap, a copy elsewhere,
        // a gap longer than WRITE_CLUSTER_GAP_BYTES, nothing written after the gap.
        let far = WRITE_CLUSTER_GAP_BYTES / bs + 1;
        let mut long = vec![victim(0, true)];
        long.extend((1..=far).map(|k| unchanged(k * bs)));
        long.push(victim((far + 1) * bs, true));
        for mut case in [
            vec![victim(0, true), victim(NO_LOC, false), victim(2 * bs, true)],
            vec![victim(0, true), unchanged(7 * bs), victim(2 * bs, true)],
            long,
            vec![victim(0, true), unchanged(bs)],
        ] {
            let before: Vec<bool> = case.iter().map(|p| p.dirty).collect();
            cluster_writes(&mut case, bs);
            assert_eq!(case.iter().map(|p| p.dirty).collect::<Vec<_>>(), before);
        }
    }

    #[test]
    fn read_runs_follow_swap_order_not_ram_order() {
        let bs = 4096;
        let plan = [
            victim(5 * bs, false),
            victim(4 * bs, false),
            victim(NO_LOC, false),
            victim(9 * bs, false),
        ];
        let (mut order, mut found) = (Vec::new(), Vec::new());
        read_runs(&plan, bs, &mut order, &mut found);
        assert_eq!(order, vec![1, 0, 3]);
        assert_eq!(found, vec![(0, 2), (2, 3)]);
    }
}
