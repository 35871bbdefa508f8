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
    let v = table.len() / c;
    out.par_chunks_mut(c).zip(ids).for_each(|(row, &id)| {
        let r = row_of(id, v, "embedding_forward");
        row.copy_from_slice(&table[r * c..][..c]);
    });
}

// Embedding backward.
//
// Forward: out[n,:] = table[ids[n],:], so d out[n,c] / d table[v,c] = [ids[n] == v] and
//   dL/dtable[v,:] = sum_{n : ids[n] == v} dout[n,:].
// Implemented exactly as, for n = 0, 1, ..., N-1 in order:
//   dtable[ids[n], :] += dout[n, :]                               (accumulates)
// Rows of dtable not named by `ids` are not touched. The loop is serial over N (the work is only
// N*C additions), which fixes the order in which repeated ids add up.

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
    for (drow, &id) in dout.chunks_exact(c).zip(ids) {
        let r = row_of(id, v, "embedding_backward");
        for (d, g) in dtable[r * c..][..c].iter_mut().zip(drow) {
            *d += g;
        }
    }
}
