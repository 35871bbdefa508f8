//! Token embedding lookup on the CPU and its backward (scatter-add into the table).

use rayon::prelude::*;

/// Checks that `id` names a row of a table with `v` rows and returns it as an index.
#[inline]
fn row_of(id: i32, v: usize, what: &str) -> usize {
    match usize::try_from(id) {
        Ok(r) if r < v => r,
        _ => panic!("{what}: token id {id} is outside the table's 0..{v} rows"),
    }
}

/// Embedding forward: `out[n, :] = table[ids[n], :]`.
///
/// out: (N, C), overwrites.
/// ids: (N), each in `0..V`.
/// table: (V, C).
pub fn embedding_forward(out: &mut [f32], ids: &[i32], table: &[f32], c: usize) {
    assert!(c > 0, "embedding_forward: C must be positive");
    assert_eq!(out.len(), ids.len() * c, "embedding_forward: out must be (N, C)");
    assert_eq!(table.len() % c, 0, "embedding_forward: table must be (V, C)");
    embedding_forward_rows(out, ids, table.len() / c, c, |r| &table[r * c..][..c]);
}

/// [`embedding_forward`] from a table of `v` rows of `c` reached one row at a time
/// (`row(r)`, C elements): for a caller that may borrow only the rows it reads.
pub fn embedding_forward_rows<'a>(
    out: &mut [f32],
    ids: &[i32],
    v: usize,
    c: usize,
    row: impl Fn(usize) -> &'a [f32] + Sync,
) {
    assert_eq!(out.len(), ids.len() * c, "embedding_forward: out must be (N, C)");
    let gather = |(out_row, &id): (&mut [f32], &i32)| {
        out_row.copy_from_slice(row(row_of(id, v, "embedding_forward")));
    };
    if gathers_serially(out.len()) {
        out.chunks_mut(c).zip(ids).for_each(gather);
    } else {
        out.par_chunks_mut(c).zip(ids).for_each(gather);
    }
}

/// Elements below which a gather called from outside every rayon pool (the CPU device's H2D
/// queue thread, or the engine's) runs on the calling thread: handing it to the global pool
/// wakes that pool's threads (50-100 µs on the 2-core validation machine, and milliseconds
/// where the device's kernels hold every core), while a single thread copies these 1 MiB in
/// about 0.1 ms.
pub const GATHER_SERIAL_ELEMS: usize = 1 << 18;

/// Whether a gather of `elems` elements runs on the calling thread ([`GATHER_SERIAL_ELEMS`]);
/// inside a pool, the pool's threads are awake and take it.
pub fn gathers_serially(elems: usize) -> bool {
    elems < GATHER_SERIAL_ELEMS && rayon::current_thread_index().is_none()
}

// Embedding backward.
//
// Forward: out[n,:] = table[ids[n],:], so d out[n,c] / d table[v,c] = [ids[n] == v] and
//   dL/dtable[v,:] = sum_{n : ids[n] == v} dout[n,:].
// Implemented exactly as, for n = 0, 1, ..., N-1 in order:
//   dtable[ids[n], :] += dout[n, :]                               (accumulates)
// Rows of dtable not named by `ids` are not touched. Every row receives its additions in the
// order of n, which fixes how repeated ids add up; in parallel, each task owns a block of the
// table's rows and walks all of `ids` for the rows in its block, so the order (and every bit) is
// the serial loop's.

/// Rows of dtable per parallel task of [`embedding_backward`]; below `SERIAL_ELEMS` additions
/// the loop stays serial.
const TASK_ROWS: usize = 2048;
const SERIAL_ELEMS: usize = 1 << 18;

/// Embedding backward; see the derivation above.
///
/// dtable: (V, C), accumulates (+=) into the rows named by `ids` only.
/// ids: (N), each in `0..V`.
/// dout: (N, C).
pub fn embedding_backward(dtable: &mut [f32], ids: &[i32], dout: &[f32], c: usize) {
    assert!(c > 0, "embedding_backward: C must be positive");
    assert_eq!(dout.len(), ids.len() * c, "embedding_backward: dout must be (N, C)");
    assert_eq!(dtable.len() % c, 0, "embedding_backward: dtable must be (V, C)");
    let v = dtable.len() / c;
    ids.iter().for_each(|&id| _ = row_of(id, v, "embedding_backward"));
    let block = |first: usize, rows: &mut [f32]| {
        let end = first + rows.len() / c;
        for (drow, &id) in dout.chunks_exact(c).zip(ids) {
            let r = id as usize;
            if (first..end).contains(&r) {
                let d = &mut rows[(r - first) * c..][..c];
                d.iter_mut().zip(drow).for_each(|(d, g)| *d += g);
            }
        }
    };
    if dout.len() < SERIAL_ELEMS {
        block(0, dtable);
    } else {
        dtable
            .par_chunks_mut(TASK_ROWS * c)
            .enumerate()
            .for_each(|(t, rows)| block(t * TASK_ROWS, rows));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parallel scatter is the serial loop, bit for bit: repeated ids (added in order of n)
    /// and a table of many row blocks.
    #[test]
    fn the_parallel_backward_is_the_serial_loop_bit_for_bit() {
        let (v, c, n) = (3 * TASK_ROWS + 5, 24, 2 * SERIAL_ELEMS / 24);
        let ids: Vec<i32> =
            (0..n).map(|i| ((i * 7919) % v) as i32 % (v as i32 / 3 + i as i32 % 3)).collect();
        let dout: Vec<f32> = (0..n * c).map(|i| ((i * 31) % 1009) as f32 * 1e-3 - 0.5).collect();
        let mut want: Vec<f32> = (0..v * c).map(|i| (i % 13) as f32 * 0.1).collect();
        let mut got = want.clone();
        for (drow, &id) in dout.chunks_exact(c).zip(&ids) {
            for (d, g) in want[id as usize * c..][..c].iter_mut().zip(drow) {
                *d += g;
            }
        }
        embedding_backward(&mut got, &ids, &dout, c);
        assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    /// A small gather from outside every pool runs on the calling thread; inside a pool, or
    /// large, on the pool; each way it is the plain row copy.
    #[test]
    fn a_small_gather_from_outside_the_pools_runs_on_the_calling_thread() {
        let (v, c) = (50, 16);
        assert!(gathers_serially(GATHER_SERIAL_ELEMS - 1));
        assert!(!gathers_serially(GATHER_SERIAL_ELEMS));
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        assert!(!pool.install(|| gathers_serially(1)));
        let table: Vec<f32> = (0..v * c).map(|i| i as f32).collect();
        for n in [3, GATHER_SERIAL_ELEMS / c + 1] {
            let ids: Vec<i32> = (0..n).map(|i| ((i * 7) % v) as i32).collect();
            let want: Vec<f32> =
                ids.iter().flat_map(|&id| table[id as usize * c..][..c].to_vec()).collect();
            let mut got = vec![0.0; n * c];
            embedding_forward(&mut got, &ids, &table, c);
            assert_eq!(got, want, "{n} rows from outside the pools");
            pool.install(|| embedding_forward(&mut got, &ids, &table, c));
            assert_eq!(got, want, "{n} rows inside a pool");
        }
    }
}
