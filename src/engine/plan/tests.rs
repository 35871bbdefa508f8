//! The plan's tests: every generated plan hazard-free, every derived wait needed, the
//! schedule's steady state, and what each shape of plan contains.

use horizon_backend::Queue;

use super::*;

fn shape(layers: usize, mbs: usize, k: usize) -> PlanShape {
    PlanShape {
        layers,
        micro_batches: mbs,
        checkpoint_every: k,
        grad_slabs: 2,
        tied: false,
        head_tiles: 1,
        kept_layers: 0,
        streamed: false,
        staged: false,
        chunked: LayerSet::default(),
        expert_chunks: 1,
        chunks_trained: false,
    }
}

/// Layers `1, 3, 5, ...` of a `layers`-layer shape stream their experts in `chunks` chunks.
fn chunked(base: PlanShape, chunks: usize) -> PlanShape {
    let mut set = LayerSet::default();
    (1..base.layers).step_by(2).for_each(|i| set.insert(i));
    set.insert(0);
    PlanShape { chunked: set, expert_chunks: chunks, ..base }
}

/// Plans whose sparse layers stream their experts in chunks are hazard-free (every depth,
/// micro-batch count, checkpoint spacing and optimizer path); each chunked layer's every pass
/// runs every chunk once per micro-batch, the two chunks resident from its last pass used
/// again first; kept internals are never a chunked layer's.
#[test]
fn chunked_expert_plans_are_hazard_free() {
    for layers in [1, 3, 4] {
        for mbs in [1, 2, 3] {
            for k in [1, 2, 3] {
                // Trained chunks (their own accumulators) only in exact mode.
                for (streamed, staged, trained) in [
                    (false, false, false),
                    (true, false, false),
                    (false, true, false),
                    (false, false, true),
                    (false, true, true),
                ] {
                    for chunks in [2, 3, 5] {
                        let base = PlanShape { streamed, staged, ..shape(layers, mbs, k) };
                        let s = Schedule::new(PlanShape {
                            chunks_trained: trained,
                            ..chunked(base, chunks)
                        });
                        let what = format!(
                            "L{layers} M{mbs} K{k} streamed {streamed} staged {staged} trained \
                             {trained} chunks {chunks}"
                        );
                        check(&s.unrolled(3), 0).unwrap_or_else(|h| panic!("{what}: {h}"));
                        let ops = s.ops(2);
                        let count =
                            |f: &dyn Fn(&OpKind) -> bool| ops.iter().filter(|o| f(&o.kind)).count();
                        // Passes over a layer's chunks: forward, the block recompute (all
                        // but a block's last layer), backward; each runs every micro-batch.
                        let passes = |l: usize| {
                            if l >= layers {
                                0
                            } else {
                                1 + usize::from(l % k != k - 1 && l != layers - 1) + 1
                            }
                        };
                        let want: usize =
                            (0..layers).filter(|&l| s.shape.chunked.contains(l)).map(passes).sum();
                        let runs = count(&|k| {
                            matches!(
                                k,
                                OpKind::ForwardExperts { .. } | OpKind::BackwardExperts { .. }
                            )
                        });
                        assert_eq!(runs, want * chunks * mbs, "{what}: chunk runs");
                        let uploads = count(&|k| {
                            matches!(
                                k,
                                OpKind::UploadWeights { what: SlotContent::Experts { .. }, .. }
                            )
                        });
                        let layers_chunked =
                            (0..layers).filter(|&l| s.shape.chunked.contains(l)).count();
                        // A chunk goes up at most once a pass, whatever the micro-batches.
                        assert!(
                            uploads <= want * chunks && uploads >= chunks * layers_chunked,
                            "{what}: {uploads} expert uploads for {want} passes of {chunks}"
                        );
                    }
                }
            }
        }
    }
    // One layer, three chunks: the forward uploads all three, and both micro-batches (or all
    // four) pass through each while it is resident; the backward walks them back and uploads
    // only the one not resident. Per micro-batch passes would have moved them 3 + 1 + 1 + 1.
    for mbs in [1, 2, 4] {
        let s = Schedule::new(chunked(shape(1, mbs, 1), 3));
        let uploads = s.ops(2).iter().filter(|o| {
            matches!(o.kind, OpKind::UploadWeights { what: SlotContent::Experts { .. }, .. })
        });
        assert_eq!(uploads.count(), 3 + 1, "{mbs} micro-batches");
    }
    let s = Schedule::new(chunked(PlanShape { kept_layers: 4, ..shape(4, 2, 1) }, 3));
    check(&s.unrolled(3), 0).unwrap();
    let kept =
        s.ops(2).iter().filter(|o| o.reads.iter().any(|r| matches!(r, Res::Stash { .. }))).count();
    assert_eq!(kept, 2, "layer 2, the one held whole, alone keeps its internals");
}

#[test]
fn generated_plans_are_hazard_free() {
    for layers in [1, 2, 3, 4, 7] {
        for mbs in [1, 2, 3] {
            for k in [1, 2, 3, 4] {
                for tied in [false, true] {
                    for (streamed, staged) in
                        [(false, false), (true, false), (false, true), (true, true)]
                    {
                        let s = Schedule::new(PlanShape {
                            tied,
                            streamed,
                            staged,
                            ..shape(layers, mbs, k)
                        });
                        check(&s.unrolled(3), 0).unwrap_or_else(|h| {
                            panic!("L{layers} M{mbs} K{k} tied {tied} streamed {streamed} staged {staged}: {h}")
                        });
                    }
                }
            }
        }
    }
}

#[test]
fn kept_internals_are_hazard_free_and_recompute_nothing() {
    for layers in [1, 3, 4] {
        for mbs in [1, 2] {
            let s = Schedule::new(PlanShape { kept_layers: layers, ..shape(layers, mbs, 1) });
            check(&s.unrolled(3), 0).unwrap_or_else(|h| panic!("L{layers} M{mbs}: {h}"));
            let ops = s.ops(2);
            let head = ops.iter().position(|o| matches!(o.kind, OpKind::Head { .. }));
            let after = &ops[head.unwrap()..];
            assert!(!after.iter().any(|o| matches!(o.kind, OpKind::Forward { .. })));
            let kept = |o: &Op| o.reads.iter().any(|r| matches!(r, Res::Stash { .. }));
            let backwards = after.iter().filter(|o| kept(o)).count();
            assert_eq!(backwards, layers * mbs, "every backward reads kept internals");
        }
    }
}

/// Some layers keep their internals, the others recompute: the plans are hazard-free, and
/// exactly the kept layers' backwards read kept internals, the kept layers spread evenly.
#[test]
fn partly_kept_internals_are_hazard_free_and_read_where_kept() {
    for layers in [1, 2, 3, 5, 7] {
        for kept in 0..=layers {
            let which: Vec<usize> =
                (0..layers).filter(|&i| keeps_internals(layers, kept, i)).collect();
            assert_eq!(which.len(), kept, "L{layers} kept {kept}: {which:?}");
            // Evenly: between two kept layers (and before the first) at most
            // ceil(L / kept) layers.
            if kept > 0 {
                let most = layers.div_ceil(kept);
                let gaps = which.iter().scan(None, |prev: &mut Option<usize>, &i| {
                    let gap = prev.map_or(i + 1, |p| i - p);
                    *prev = Some(i);
                    Some(gap)
                });
                assert!(gaps.into_iter().all(|g| g <= most), "L{layers} {which:?}");
            }
            for (mbs, streamed, staged) in [(1, false, false), (2, true, false), (2, false, true)] {
                let shape =
                    PlanShape { kept_layers: kept, streamed, staged, ..shape(layers, mbs, 1) };
                let s = Schedule::new(shape);
                check(&s.unrolled(3), 0).unwrap_or_else(|h| {
                    panic!("L{layers} kept {kept} M{mbs} streamed {streamed}: {h}")
                });
                for op in s.ops(2) {
                    if let OpKind::Backward { layer, .. } = op.kind {
                        let reads = op.reads.iter().any(|r| matches!(r, Res::Stash { .. }));
                        assert_eq!(reads, shape.keeps(layer), "L{layers} kept {kept}: {op}");
                    }
                }
            }
        }
    }
}

#[test]
fn every_wait_is_needed() {
    // Removing any single wait from an unrolled two-step plan must be caught: the
    // derivation adds a wait only where the ops are not yet ordered.
    for streamed in [false, true] {
        for staged in [false, true] {
            let s = Schedule::new(PlanShape { streamed, staged, ..shape(4, 2, 2) });
            every_wait_is_needed_in(s);
        }
    }
}

/// Staged uploads: every upload copies its slot's stage, which one `StageWeights` of the
/// same weights, on the host queue, filled after the slot's previous upload; the first
/// uploads of a step are staged by the step before, after the optimizer wrote them.
#[test]
fn staged_uploads_copy_a_stage_filled_ahead() {
    for (streamed, tiles, keep) in [(false, 1, false), (true, 1, false), (false, 3, true)] {
        let k = if keep { 1 } else { 2 };
        let shape = PlanShape {
            streamed,
            staged: true,
            head_tiles: tiles,
            kept_layers: if keep { 4 } else { 0 },
            ..shape(4, 2, k)
        };
        let s = Schedule::new(shape);
        let ops = s.unrolled(3);
        let n = s.len();
        let kinds = |f: fn(&OpKind) -> bool| ops[n..].iter().filter(|o| f(&o.kind)).count();
        let stages = kinds(|k| matches!(k, OpKind::StageWeights { .. }));
        assert_eq!(stages, kinds(|k| matches!(k, OpKind::UploadWeights { .. })));
        for (j, op) in ops.iter().enumerate().skip(n) {
            let OpKind::UploadWeights { slot, what } = op.kind else { continue };
            assert_eq!(op.reads, vec![Res::WeightStage(slot)], "{op}");
            let stage = ops[..j].iter().rposition(|o| o.writes.contains(&Res::WeightStage(slot)));
            let st = &ops[stage.expect("a stage before every upload")];
            assert_eq!(st.kind, OpKind::StageWeights { slot, what }, "{op}");
            assert_eq!(st.queue, Queue::Host);
            let uploads_between = ops[stage.unwrap()..j]
                .iter()
                .filter(|o| matches!(o.kind, OpKind::UploadWeights { slot: s, .. } if s == slot))
                .count();
            assert_eq!(uploads_between, 0, "the stage of {op} is not overwritten first");
        }
        // The next step's first stage (of layer 0) follows layer 0's last write.
        let first = s.steady.iter().position(|o| {
            matches!(o.kind, OpKind::StageWeights { what: SlotContent::Layer(0), .. })
        });
        let last_write =
            s.steady.iter().rposition(|o| o.writes.contains(&Res::Params(ParamBuf::Layer(0))));
        let wrap = s.steady.iter().rposition(|o| {
            matches!(o.kind, OpKind::StageWeights { what: SlotContent::Layer(0), .. })
        });
        assert!(first.is_some() && wrap.unwrap() > last_write.unwrap());
    }
}

#[test]
fn streamed_updates_keep_no_layer_gradient() {
    // lean/compact: no op touches a host layer gradient. With 2 slabs, layers 3 and 2 are
    // updated from their slabs right after the slabs arrive, before the layers below them
    // are back; layers 1 and 0 (whose slabs no later layer of the step needs) and the host
    // buffers are updated after the norm.
    for tied in [false, true] {
        let s = Schedule::new(PlanShape { tied, streamed: true, ..shape(4, 2, 2) });
        for op in &s.steady {
            for r in op.reads.iter().chain(&op.writes) {
                assert!(!matches!(r, Res::Grads(ParamBuf::Layer(_))), "{op} touches {r:?}");
            }
        }
        let pos = |f: &dyn Fn(&OpKind) -> bool| s.steady.iter().position(|op| f(&op.kind));
        let upd = |i| pos(&|k| matches!(k, OpKind::SlabUpdate { layer, .. } if *layer == i));
        let held = |i| pos(&|k| matches!(k, OpKind::HeldSlabUpdate { layer, .. } if *layer == i));
        let bwd0 = pos(&|k| matches!(k, OpKind::Backward { layer: 0, .. })).unwrap();
        let norm = pos(&|k| *k == OpKind::GradNorm).unwrap();
        assert!(upd(3).unwrap() < bwd0 && upd(2).unwrap() < bwd0, "streamed before layer 0");
        assert!(upd(1).is_none() && upd(0).is_none());
        assert!(held(0).unwrap() > norm && held(1).unwrap() > held(0).unwrap());
        for p in s.shape.param_bufs().into_iter().filter(|p| !matches!(p, ParamBuf::Layer(_))) {
            let kind = match p {
                ParamBuf::Embed => OpKind::EmbedUpdate { next: true },
                p => OpKind::Update { what: p },
            };
            assert!(pos(&|k| *k == kind).unwrap() > norm, "{p:?}");
        }
        // The embedding's other rows last, after the layers the next forward needs first.
        let rest = pos(&|k| *k == OpKind::EmbedUpdate { next: false }).unwrap();
        assert!(rest > held(1).unwrap() && rest == s.steady.len() - 1);
        // The next step's uploads wait for the updates of their own layer only.
        for (j, op) in s.steady.iter().enumerate() {
            if let OpKind::UploadWeights { what: SlotContent::Layer(i), .. } = op.kind {
                for w in s.waits(1, j) {
                    if let Wait::Prev(p) = w {
                        assert!(
                            matches!(s.first[p].kind,
                                OpKind::SlabUpdate { layer, .. } | OpKind::HeldSlabUpdate { layer, .. }
                                if layer == i),
                            "{op} waits for {}",
                            s.first[p]
                        );
                    }
                }
            }
        }
    }
}

fn every_wait_is_needed_in(s: Schedule) {
    let ops = s.unrolled(2);
    let mut rejected = 0;
    let mut total = 0;
    for j in 0..ops.len() {
        for w in 0..ops[j].waits.len() {
            total += 1;
            let mut broken = ops.clone();
            broken[j].waits.remove(w);
            if check(&broken, 0).is_err() {
                rejected += 1;
            }
        }
    }
    assert!(total > 0);
    assert_eq!(rejected, total, "{} of {total} waits were redundant", total - rejected);
}

#[test]
fn checker_rejects_missing_waits() {
    use Queue::*;
    let op = |queue, reads: Vec<Res>, writes: Vec<Res>, waits: Vec<usize>| Op {
        kind: OpKind::GradNorm,
        queue,
        reads,
        writes,
        waits,
    };
    // Upload into a slot, compute reads it without waiting: read-after-write.
    let raw = vec![
        op(H2D, vec![], vec![Res::Slot(0)], vec![]),
        op(Compute, vec![Res::Slot(0)], vec![], vec![]),
    ];
    assert!(matches!(check(&raw, 0), Err(Hazard::Unordered { what: "read-after-write", .. })));
    // Compute reads the slot, the next upload overwrites it without waiting: write-after-read.
    let war = vec![
        op(H2D, vec![], vec![Res::Slot(0)], vec![]),
        op(Compute, vec![Res::Slot(0)], vec![], vec![0]),
        op(H2D, vec![], vec![Res::Slot(0)], vec![]),
    ];
    assert!(matches!(check(&war, 0), Err(Hazard::Unordered { what: "write-after-read", .. })));
    let mut fixed = war.clone();
    fixed[2].waits.push(1);
    check(&fixed, 0).unwrap();
    // Ordering through a chain of waits across a third queue counts.
    let chain = vec![
        op(H2D, vec![], vec![Res::Slot(0)], vec![]),
        op(Host, vec![], vec![Res::Norm], vec![0]),
        op(Compute, vec![Res::Slot(0), Res::Norm], vec![], vec![1]),
    ];
    check(&chain, 0).unwrap();
    // A wait on a later op is invalid.
    let bad = vec![op(H2D, vec![], vec![], vec![1]), op(H2D, vec![], vec![], vec![])];
    assert!(check(&bad, 0).is_err());
}

#[test]
fn removing_a_slot_wait_from_a_real_plan_is_caught() {
    let s = Schedule::new(shape(4, 1, 2));
    let mut ops = s.unrolled(2);
    let j = ops
        .iter()
        .position(|op| matches!(op.kind, OpKind::Forward { .. }) && !op.waits.is_empty())
        .expect("a forward that waits for its upload");
    ops[j].waits.clear();
    assert!(check(&ops, 0).is_err());
}

#[test]
fn uploads_per_layer() {
    // K = 1: each layer is uploaded for the forward and once more for its recompute and
    // backward; the last layer is still resident from the forward when its backward runs.
    let s = Schedule::new(shape(4, 2, 1));
    assert_eq!(s.uploads_per_layer(), vec![2, 2, 2, 1]);
    // K = 2: a block's first layer is uploaded for the recompute and stays for its backward;
    // its last layer is uploaded for backward only.
    let s = Schedule::new(shape(4, 2, 2));
    assert_eq!(s.uploads_per_layer(), vec![2, 2, 2, 2]);
    // K = 4: the middle layers of a block are recomputed, then uploaded once more for
    // backward, except the one still resident when the backward reaches it.
    let s = Schedule::new(shape(8, 1, 4));
    assert_eq!(s.uploads_per_layer(), vec![3, 3, 2, 2, 3, 3, 2, 2]);
}

#[test]
fn with_k1_a_checkpoint_lands_during_the_backward_above_it() {
    for kept in [0, 4] {
        let s = Schedule::new(PlanShape { kept_layers: kept, ..shape(4, 2, 1) });
        let ops = &s.steady;
        // Whether op `a` of the steady step is ordered before op `b`: through waits within
        // the step or the queues' order.
        let before = |a: usize, b: usize| {
            let mut stack = vec![b];
            let mut seen = vec![false; ops.len()];
            while let Some(j) = stack.pop() {
                let prev_on_queue = (0..j).rev().find(|&i| ops[i].queue == ops[j].queue);
                let waits = s.waits(1, j).filter_map(|w| match w {
                    Wait::This(i) => Some(i),
                    Wait::Prev(_) => None,
                });
                for i in waits.chain(prev_on_queue) {
                    if i == a {
                        return true;
                    }
                    if !std::mem::replace(&mut seen[i], true) {
                        stack.push(i);
                    }
                }
            }
            false
        };
        let pos = |f: &dyn Fn(&OpKind) -> bool| ops.iter().position(|op| f(&op.kind)).unwrap();
        for block in 0..3 {
            let upload = pos(
                &|k| matches!(k, OpKind::UploadAct { m: 0, from: ActSource::Ckpt(b), .. } if *b == block),
            );
            let above =
                pos(&|k| matches!(k, OpKind::Backward { layer, m: 0, .. } if *layer == block + 1));
            assert!(!before(above, upload), "kept {kept}, block {block}");
        }
    }
}

#[test]
fn the_next_forward_waits_only_for_its_own_update() {
    let s = Schedule::new(shape(4, 2, 2));
    let update_of = |p: ParamBuf| {
        let kind = match p {
            ParamBuf::Embed => OpKind::EmbedUpdate { next: true },
            p => OpKind::Update { what: p },
        };
        s.first.iter().position(|op| op.kind == kind).unwrap()
    };
    for (j, op) in s.steady.iter().enumerate() {
        let prev: Vec<usize> = s
            .waits(1, j)
            .filter_map(|w| if let Wait::Prev(i) = w { Some(i) } else { None })
            .collect();
        match op.kind {
            OpKind::UploadWeights { what: SlotContent::Layer(i), .. } if !prev.is_empty() => {
                assert_eq!(prev, vec![update_of(ParamBuf::Layer(i))], "{op}");
            }
            OpKind::EmbedGather { m: 0 } => assert_eq!(prev, vec![update_of(ParamBuf::Embed)]),
            _ => {}
        }
    }
    // Layer 0's first upload of a step waits for layer 0's update of the previous step.
    let j = s
        .steady
        .iter()
        .position(|op| matches!(op.kind, OpKind::UploadWeights { what: SlotContent::Layer(0), .. }))
        .unwrap();
    assert!(s.waits(1, j).any(|w| w == Wait::Prev(update_of(ParamBuf::Layer(0)))));
}

#[test]
fn tiled_heads_are_hazard_free() {
    for layers in [1, 2, 4] {
        for mbs in [1, 2, 3] {
            for k in [1, 2, 3] {
                for tiles in [2, 3, 5] {
                    for (tied, streamed, keep) in [
                        (false, false, false),
                        (true, false, false),
                        (false, true, false),
                        (true, true, false),
                        (false, false, true),
                    ] {
                        if keep && k != 1 {
                            continue;
                        }
                        for staged in [false, true] {
                            let s = Schedule::new(PlanShape {
                                tied,
                                streamed,
                                kept_layers: if keep { layers } else { 0 },
                                head_tiles: tiles,
                                staged,
                                ..shape(layers, mbs, k)
                            });
                            check(&s.unrolled(3), 0).unwrap_or_else(|h| {
                                panic!(
                                    "L{layers} M{mbs} K{k} tiles {tiles} tied {tied} \
                                     streamed {streamed} keep {keep} staged {staged}: {h}"
                                )
                            });
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn every_wait_of_a_tiled_head_is_needed() {
    for (tiles, streamed, tied) in [(2, false, false), (3, true, false), (4, false, true)] {
        every_wait_is_needed_in(Schedule::new(PlanShape {
            streamed,
            tied,
            head_tiles: tiles,
            ..shape(4, 2, 2)
        }));
    }
}

#[test]
fn a_tiled_head_passes_each_tile_twice_and_uploads_each_at_most_twice() {
    for tiles in [2, 3, 5] {
        let s = Schedule::new(PlanShape { head_tiles: tiles, ..shape(3, 2, 1) });
        let ops = s.ops(2);
        let count = |f: &dyn Fn(&OpKind) -> bool| ops.iter().filter(|o| f(&o.kind)).count();
        for t in 0..tiles {
            let uploads = count(
                &|k| matches!(k, OpKind::UploadWeights { what: SlotContent::HeadTile(x), .. } if *x == t),
            );
            // The last two tiles of pass 1 are still resident when pass 2 starts with them.
            assert_eq!(uploads, if t + 2 >= tiles { 1 } else { 2 }, "tiles {tiles}, tile {t}");
            let stats = count(&|k| matches!(k, OpKind::HeadStats { tile, .. } if *tile == t));
            let grads = count(&|k| matches!(k, OpKind::HeadGrad { tile, .. } if *tile == t));
            assert_eq!((stats, grads), (2, 2), "every micro-batch, both passes");
            let down =
                count(&|k| matches!(k, OpKind::DownloadHeadTileGrads { tile, .. } if *tile == t));
            assert_eq!(down, 1);
        }
        // Only the first tile of pass 2 (the last tile) overwrites dhf.
        let firsts: Vec<usize> = ops
            .iter()
            .filter_map(|o| match o.kind {
                OpKind::HeadGrad { tile, first: true, .. } => Some(tile),
                _ => None,
            })
            .collect();
        assert_eq!(firsts, vec![tiles - 1, tiles - 1]);
        assert_eq!(
            count(&|k| matches!(k, OpKind::Head { .. } | OpKind::DownloadHeadGrads { .. })),
            0
        );
        assert_eq!(count(&|k| matches!(k, OpKind::HeadFinish { .. })), 2);
        assert_eq!(count(&|k| *k == OpKind::DownloadNormGrads), 1);
        // Pass 2 starts after every micro-batch's statistics are complete.
        let last_stats =
            ops.iter().rposition(|o| matches!(o.kind, OpKind::HeadStats { .. })).unwrap();
        let first_grad =
            ops.iter().position(|o| matches!(o.kind, OpKind::HeadGrad { .. })).unwrap();
        assert!(last_stats < first_grad);
    }
}

#[test]
fn micro_batches_do_not_multiply_uploads() {
    for mbs in [1, 2, 4] {
        let s = Schedule::new(shape(4, mbs, 2));
        assert_eq!(s.uploads_per_layer(), vec![2, 2, 2, 2], "M = {mbs}");
    }
}

/// An evaluation is a plan like a step's: hazard-free for every shape (whole and tiled heads,
/// kept internals, staged steps), forward only (no checkpoint, gradient, update or stage), one
/// forward per layer, and every one of its waits needed.
#[test]
fn eval_plans_are_hazard_free_forward_only_and_every_wait_is_needed() {
    for layers in [1, 2, 3, 5] {
        for (tiles, kept, staged) in
            [(1, 0, false), (3, 0, true), (1, layers, false), (2, 1, false)]
        {
            let s =
                PlanShape { head_tiles: tiles, kept_layers: kept, staged, ..shape(layers, 2, 1) };
            let ops = eval_plan(s);
            let name = format!("L{layers} tiles {tiles} kept {kept} staged {staged}");
            check(&ops, 0).unwrap_or_else(|h| panic!("{name}: {h}"));
            let host_state = |r: &Res| {
                matches!(
                    r,
                    Res::Params(_)
                        | Res::Grads(_)
                        | Res::Moments(_)
                        | Res::Ckpt { .. }
                        | Res::Dw(_)
                ) || matches!(r, Res::Dres(_) | Res::WeightStage(_) | Res::Norm | Res::StepStats)
            };
            for op in &ops {
                assert!(!op.writes.iter().any(host_state), "{name}: {op} writes step state");
                assert!(!op.reads.iter().any(|r| matches!(r, Res::WeightStage(_))), "{name}: {op}");
            }
            let forwards = ops.iter().filter(|o| matches!(o.kind, OpKind::Forward { .. })).count();
            assert_eq!(forwards, layers, "{name}");
            let last = ops.last().expect("ops").kind;
            assert_eq!(last, OpKind::DownloadLosses { m: 0 }, "{name}");
            for j in 0..ops.len() {
                for w in 0..ops[j].waits.len() {
                    let mut cut = ops.clone();
                    cut[j].waits.remove(w);
                    assert!(check(&cut, 0).is_err(), "{name}: wait {w} of op {j} is not needed");
                }
            }
        }
    }
}
