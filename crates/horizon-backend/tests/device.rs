//! Tests of `CpuDevice`: the pool (capacity, peak, coalescing, alignment), copies and kernels
//! through the queues, event ordering across queues under random copy delays, ordering within a
//! queue, the link simulation and its counters, panics in queued work, and the weight (fp32 and
//! bf16) and bf16 gradient copies.
//!
//! Timing asserts are lower bounds only (a copy of N bytes takes at least N / bandwidth), or
//! exact identities of the counters; shared machines are too noisy for upper bounds.

use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use horizon_backend::cpu::device::ALIGN_ELEMS;
use horizon_backend::cpu::testing::Rng;
use horizon_backend::cpu::{CpuDevice, CpuDeviceConfig, WaitMode};
use horizon_backend::{Backend, Bf16, DevBuf, Device, Event, HostPtr, HostPtrMut, Queue};
use rayon::prelude::*;

fn device(capacity_bytes: usize) -> CpuDevice {
    CpuDevice::new(CpuDeviceConfig::with_capacity(capacity_bytes))
}

/// Uploads `data` into `dst` and waits for it.
fn upload_now(dev: &CpuDevice, dst: DevBuf, data: &[f32]) {
    // SAFETY: `data` outlives the synchronize below, which runs the upload.
    dev.upload(dst, unsafe { HostPtr::new(data) });
    dev.synchronize();
}

/// Downloads `src` once everything queued so far has run, and waits for it.
fn download_now(dev: &CpuDevice, src: DevBuf) -> Vec<f32> {
    dev.synchronize();
    let mut out = vec![0.0; src.len];
    // SAFETY: `out` is not touched until the synchronize below has run the download.
    dev.download(unsafe { HostPtrMut::new(&mut out) }, src);
    dev.synchronize();
    out
}

// ---- the pool ---------------------------------------------------------------------------------

#[test]
fn alloc_enforces_capacity_and_the_error_carries_the_numbers() {
    let dev = device(6400); // 1600 elements
    let a = dev.alloc(1000).unwrap(); // takes 1008 (aligned)
    assert_eq!(a.len, 1000);
    assert_eq!(dev.stats().in_use_bytes, 1008 * 4);
    let err = dev.alloc(1000).unwrap_err();
    assert_eq!(err.requested_bytes, 4000);
    assert_eq!(err.in_use_bytes, 4032);
    assert_eq!(err.capacity_bytes, 6400);
    let msg = err.to_string();
    assert!(msg.contains("4000") && msg.contains("4032") && msg.contains("6400"), "{msg}");
    // What is left still fits, exactly.
    let b = dev.alloc(1600 - 1008).unwrap();
    assert_eq!(dev.stats().in_use_bytes, 6400);
    assert!(dev.alloc(1).is_err());
    dev.free(a);
    dev.free(b);
    assert_eq!(dev.stats().in_use_bytes, 0);
}

#[test]
fn capacity_is_rounded_down_to_whole_alignment_units() {
    let dev = device(1000); // 250 elements -> 240 usable
    assert_eq!(dev.stats().capacity_bytes, 960);
    assert!(dev.alloc(241).is_err());
    assert!(dev.alloc(240).is_ok());
}

#[test]
fn peak_is_recorded() {
    let dev = device(1 << 20);
    let a = dev.alloc(1600).unwrap();
    let b = dev.alloc(3200).unwrap();
    dev.free(a);
    let c = dev.alloc(16).unwrap();
    let s = dev.stats();
    assert_eq!(s.in_use_bytes, (3200 + 16) * 4);
    assert_eq!(s.peak_bytes, (1600 + 3200) * 4);
    dev.free(b);
    dev.free(c);
    assert_eq!(dev.stats().peak_bytes, (1600 + 3200) * 4);
}

#[test]
fn free_coalesces_so_a_big_buffer_fits_again() {
    let dev = device(1024 * 4);
    let bufs: Vec<DevBuf> = (0..4).map(|_| dev.alloc(256).unwrap()).collect();
    assert!(dev.alloc(16).is_err());
    // Two adjacent holes in the middle merge into one of 512.
    dev.free(bufs[1]);
    dev.free(bufs[2]);
    let mid = dev.alloc(512).unwrap();
    assert_eq!(mid.off, bufs[1].off);
    // Free in an order that needs merging with both neighbours: 0, then 3, then the middle.
    dev.free(bufs[0]);
    dev.free(bufs[3]);
    assert!(dev.alloc(512).is_err(), "two separate holes of 256 must not hold 512");
    dev.free(mid);
    let all = dev.alloc(1024).unwrap();
    assert_eq!(all.off, 0);
    dev.free(all);
}

#[test]
fn every_buffer_is_aligned_to_64_bytes() {
    let dev = device(1 << 20);
    let bufs: Vec<DevBuf> =
        [1, 3, 17, 100, 15, 16, 33].iter().map(|&n| dev.alloc(n).unwrap()).collect();
    for b in &bufs {
        assert_eq!(b.off % ALIGN_ELEMS, 0, "{b:?}");
    }
    let misaligned = Arc::new(Mutex::new(Vec::new()));
    let (m, bs) = (Arc::clone(&misaligned), bufs.clone());
    dev.launch(Box::new(move |v| {
        for b in bs {
            if !(v.buf(b).as_ptr() as usize).is_multiple_of(64) {
                m.lock().unwrap().push(b);
            }
        }
    }));
    dev.synchronize();
    assert!(misaligned.lock().unwrap().is_empty(), "{:?}", misaligned.lock().unwrap());
}

#[test]
fn alloc_zero_is_an_empty_buffer() {
    let dev = device(64);
    let e = dev.alloc(0).unwrap();
    assert_eq!(e.len, 0);
    let full = dev.alloc(16).unwrap();
    dev.free(e);
    assert_eq!(dev.stats().in_use_bytes, 64);
    dev.free(full);
    assert!(download_now(&dev, e).is_empty());
}

#[test]
#[should_panic(expected = "not a live allocation")]
fn double_free_panics() {
    let dev = device(1 << 12);
    let a = dev.alloc(10).unwrap();
    dev.free(a);
    dev.free(a);
}

// ---- copies and kernels -----------------------------------------------------------------------

#[test]
fn upload_launch_download_round_trip() {
    let dev = device(1 << 20);
    let n = 5003; // not a multiple of anything
    let mut rng = Rng::new(1);
    let (a, b) = (rng.vec(n, 1.0), rng.vec(n, 1.0));
    let (da, db, dout) = (dev.alloc(n).unwrap(), dev.alloc(n).unwrap(), dev.alloc(n).unwrap());
    upload_now(&dev, da, &a);
    upload_now(&dev, db, &b);
    dev.launch(Box::new(move |v| {
        // SAFETY: dout is disjoint from da and db, and nothing else runs on it.
        let out = unsafe { v.buf_mut(dout) };
        v.backend().residual_forward(out, v.buf(da), v.buf(db));
    }));
    let got = download_now(&dev, dout);
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    assert_eq!(got, want);
}

#[test]
fn i32_upload_is_read_by_ibuf() {
    let dev = device(1 << 20);
    let (v_rows, c) = (7, 5);
    let table: Vec<f32> = (0..v_rows * c).map(|i| i as f32 * 0.5).collect();
    let ids = Arc::new(vec![3, 0, 6, 6, 1, 2, 5, 4]);
    let n = ids.len();
    let (dtable, dids, dout) =
        (dev.alloc(table.len()).unwrap(), dev.alloc(n).unwrap(), dev.alloc(n * c).unwrap());
    upload_now(&dev, dtable, &table);
    dev.upload_i32(dids, Arc::clone(&ids));
    let uploaded = Event::new();
    dev.record(Queue::H2D, &uploaded);
    dev.wait(Queue::Compute, &uploaded);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = Arc::clone(&seen);
    dev.launch(Box::new(move |v| {
        s.lock().unwrap().extend_from_slice(v.ibuf(dids));
        // SAFETY: dout is disjoint from dids and dtable.
        let out = unsafe { v.buf_mut(dout) };
        v.backend().embedding_forward(out, v.ibuf(dids), v.buf(dtable), c);
    }));
    let got = download_now(&dev, dout);
    assert_eq!(*seen.lock().unwrap(), *ids);
    let want: Vec<f32> =
        ids.iter().flat_map(|&id| table[id as usize * c..][..c].to_vec()).collect();
    assert_eq!(got, want);
    // Negative ids (the ignored target) survive the trip bit for bit.
    let neg = Arc::new(vec![-100, i32::MIN, i32::MAX, -1]);
    let dneg = dev.alloc(neg.len()).unwrap();
    dev.upload_i32(dneg, Arc::clone(&neg));
    dev.synchronize();
    let s = Arc::clone(&seen);
    s.lock().unwrap().clear();
    dev.launch(Box::new(move |v| s.lock().unwrap().extend_from_slice(v.ibuf(dneg))));
    dev.synchronize();
    assert_eq!(*seen.lock().unwrap(), *neg);
}

// ---- ordering ---------------------------------------------------------------------------------

/// H2D -> Compute -> D2H -> Host, each step ordered by an event, many iterations in flight at
/// once, with up to 2 ms of random delay before every copy. If any wait were ignored, a kernel
/// would read a zero (never uploaded) input or the host would check a stale download. Both
/// ways of waiting on the compute and host queues.
#[test]
fn events_order_work_across_queues_under_jitter() {
    for wait in [WaitMode::Block, WaitMode::Spin] {
        events_order_work_across_queues(wait);
    }
}

fn events_order_work_across_queues(wait: WaitMode) {
    let cfg = CpuDeviceConfig {
        copy_jitter_us: 2000,
        jitter_seed: 7,
        wait,
        ..CpuDeviceConfig::with_capacity(64 << 20)
    };
    let dev = CpuDevice::new(cfg);
    // The host work runs on its own pool, which a spinning host queue keeps spinning.
    let pool = Arc::new(rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap());
    dev.host_threads(pool.clone());
    let iters = 60;
    let mut rng = Rng::new(2);
    let inputs: Vec<Vec<f32>> = (0..iters).map(|i| rng.vec(1000 + 37 * i, 1.0)).collect();
    let mut outputs: Vec<Vec<f32>> = inputs.iter().map(|x| vec![0.0; x.len()]).collect();
    let verdicts = Arc::new(Mutex::new(Vec::new()));
    for (i, (x, out)) in inputs.iter().zip(outputs.iter_mut()).enumerate() {
        let (dx, dy) = (dev.alloc(x.len()).unwrap(), dev.alloc(x.len()).unwrap());
        // SAFETY: `inputs` is not touched until the synchronize at the end.
        dev.upload(dx, unsafe { HostPtr::new(x) });
        let uploaded = Event::new();
        dev.record(Queue::H2D, &uploaded);

        dev.wait(Queue::Compute, &uploaded);
        dev.launch(Box::new(move |v| {
            // SAFETY: dy is disjoint from dx.
            let y = unsafe { v.buf_mut(dy) };
            v.backend().residual_forward(y, v.buf(dx), v.buf(dx));
        }));
        let computed = Event::new();
        dev.record(Queue::Compute, &computed);

        dev.wait(Queue::D2H, &computed);
        // SAFETY: `outputs[i]` is only read by the host work below (ordered after the download
        // by `downloaded`) and after the final synchronize.
        let dst = unsafe { HostPtrMut::new(out) };
        dev.download(dst, dy);
        let downloaded = Event::new();
        dev.record(Queue::D2H, &downloaded);

        dev.wait(Queue::Host, &downloaded);
        // SAFETY: as above: the download that writes `out` has run when this runs.
        let (got, want) = (unsafe { HostPtr::new(out) }, unsafe { HostPtr::new(x) });
        let (verdicts, pool) = (Arc::clone(&verdicts), pool.clone());
        dev.host(Box::new(move || {
            // SAFETY: both buffers outlive the final synchronize and are not written meanwhile.
            let (got, want) = unsafe { (got.as_slice(), want.as_slice()) };
            let ok = pool.install(|| got.par_iter().zip(want).all(|(g, w)| *g == w + w));
            verdicts.lock().unwrap().push((i, ok));
        }));
    }
    dev.synchronize();
    for (x, out) in inputs.iter().zip(&outputs) {
        let want: Vec<f32> = x.iter().map(|v| v + v).collect();
        assert_eq!(*out, want);
    }
    let verdicts = verdicts.lock().unwrap();
    let want: Vec<(usize, bool)> = (0..iters).map(|i| (i, true)).collect();
    assert_eq!(*verdicts, want, "host work saw a download before it finished, or out of order");
}

/// A spinning compute queue keeps the kernel threads busy while it waits for a copy that runs
/// its bf16 pass on the global pool: the wait ends (a spinner that the pass's pool could run
/// nested inside the pass would hang here), and the kernel sees the copy's result.
#[test]
fn a_spinning_wait_lets_the_copy_it_waits_for_run() {
    let cfg = CpuDeviceConfig { wait: WaitMode::Spin, ..CpuDeviceConfig::with_capacity(64 << 20) };
    let dev = CpuDevice::new(cfg);
    // Many chunks of the bf16 passes' parallel split, so the pass does go to the pool.
    let n = 1 << 20;
    let src: Vec<Bf16> = (0..n).map(|i| Bf16::from_f32((i % 251) as f32)).collect();
    let (a, b) = (dev.alloc(n).unwrap(), dev.alloc(n).unwrap());
    for round in 0..4 {
        // SAFETY: `src` outlives the synchronize below.
        dev.upload_weights_bf16(a, 0, unsafe { HostPtr::new(&src) });
        let uploaded = Event::new();
        dev.record(Queue::H2D, &uploaded);
        dev.wait(Queue::Compute, &uploaded);
        dev.launch(Box::new(move |v| {
            // SAFETY: b is disjoint from a.
            let y = unsafe { v.buf_mut(b) };
            v.backend().residual_forward(y, v.buf(a), v.buf(a));
        }));
        let got = download_now(&dev, b);
        let want: Vec<f32> = src.iter().map(|x| 2.0 * x.to_f32()).collect();
        assert_eq!(got, want, "round {round}");
    }
}

#[test]
fn work_on_one_queue_runs_in_submission_order() {
    let cfg = CpuDeviceConfig {
        copy_jitter_us: 300,
        jitter_seed: 3,
        ..CpuDeviceConfig::with_capacity(1 << 20)
    };
    let dev = CpuDevice::new(cfg);
    // Host and compute: append indices.
    let log = Arc::new(Mutex::new(Vec::new()));
    for i in 0..200 {
        let l = Arc::clone(&log);
        dev.host(Box::new(move || l.lock().unwrap().push(i)));
        let l = Arc::clone(&log);
        dev.launch(Box::new(move |_| l.lock().unwrap().push(1000 + i)));
    }
    dev.synchronize();
    let log = log.lock().unwrap();
    let host: Vec<i32> = log.iter().copied().filter(|&i| i < 1000).collect();
    let compute: Vec<i32> = log.iter().copied().filter(|&i| i >= 1000).collect();
    assert_eq!(host, (0..200).collect::<Vec<_>>());
    assert_eq!(compute, (1000..1200).collect::<Vec<_>>());
    // H2D: successive uploads to one buffer; the last one wins. D2H: successive downloads of
    // that buffer into distinct host buffers see the same final data.
    let n = 256;
    let buf = dev.alloc(n).unwrap();
    let sources: Vec<Vec<f32>> = (0..20).map(|k| vec![k as f32; n]).collect();
    for s in &sources {
        // SAFETY: `sources` lives until after the synchronize.
        dev.upload(buf, unsafe { HostPtr::new(s) });
    }
    dev.synchronize();
    assert_eq!(download_now(&dev, buf), sources[19]);
}

// ---- the link simulation and the counters -----------------------------------------------------

#[test]
fn link_simulation_bounds_copy_time_and_counters_move() {
    let cfg = CpuDeviceConfig { link_gbps: 1.0, ..CpuDeviceConfig::with_capacity(64 << 20) };
    let dev = CpuDevice::new(cfg);
    let n = 1 << 20;
    let bytes = (n * 4) as u64;
    let min_s = bytes as f64 / 1e9; // 4.19 ms at 1 GB/s
    let data = vec![1.5f32; n];
    let (a, b) = (dev.alloc(n).unwrap(), dev.alloc(n).unwrap());

    let t = Instant::now();
    upload_now(&dev, a, &data);
    let took = t.elapsed().as_secs_f64();
    assert!(took >= min_s, "upload of {bytes} B took {took} s, less than {min_s} s");
    let s = dev.stats();
    assert_eq!(s.h2d_bytes, bytes);
    assert_eq!(s.d2h_bytes, 0);
    assert!(s.h2d_busy_s >= min_s, "{s:?}");
    assert!(s.link_busy_s >= min_s, "{s:?}");
    assert_eq!(s.d2h_busy_s, 0.0);
    assert_eq!(s.compute_busy_s, 0.0);

    // An upload and a download at once: each direction has its own bandwidth, so they overlap;
    // the link is busy for the union of the two intervals.
    let mut out = vec![0.0f32; n];
    // SAFETY: `data` is not written until the synchronize.
    dev.upload(b, unsafe { HostPtr::new(&data) });
    // SAFETY: `out` is not touched until the synchronize.
    dev.download(unsafe { HostPtrMut::new(&mut out) }, a);
    dev.synchronize();
    assert_eq!(out, data);
    let s2 = dev.stats();
    assert_eq!(s2.h2d_bytes, 2 * bytes);
    assert_eq!(s2.d2h_bytes, bytes);
    assert!(s2.h2d_busy_s >= 2.0 * min_s, "{s2:?}");
    assert!(s2.d2h_busy_s >= min_s, "{s2:?}");
    assert!(s2.link_busy_s >= s.link_busy_s + min_s, "{s2:?}");
    // The union never exceeds the sum of the copy queues' busy time (every copy's link interval
    // lies inside its queue's busy interval).
    assert!(s2.link_busy_s <= s2.h2d_busy_s + s2.d2h_busy_s + 1e-9, "{s2:?}");

    // Busy time counts running, not waiting: compute only waits here.
    let e = Event::new();
    dev.host(Box::new(|| std::thread::sleep(Duration::from_millis(20))));
    dev.record(Queue::Host, &e);
    dev.wait(Queue::Compute, &e);
    dev.synchronize();
    let s3 = dev.stats();
    assert!(s3.host_busy_s >= 0.020, "{s3:?}");
    assert_eq!(s3.compute_busy_s, 0.0, "waiting on an event counted as busy");
    dev.launch(Box::new(|_| std::thread::sleep(Duration::from_millis(2))));
    dev.synchronize();
    assert!(dev.stats().compute_busy_s >= 0.002);
    // Copies are no longer in flight, so the link counter stands still.
    assert_eq!(dev.stats().link_busy_s, s3.link_busy_s);
}

#[test]
fn unthrottled_copies_count_bytes() {
    let dev = device(1 << 20);
    let buf = dev.alloc(100).unwrap();
    upload_now(&dev, buf, &[2.0; 100]);
    dev.upload_i32(buf.prefix(10), Arc::new(vec![1; 10]));
    let _ = download_now(&dev, buf);
    let s = dev.stats();
    assert_eq!((s.h2d_bytes, s.d2h_bytes), (440, 400));
    assert!(s.link_busy_s > 0.0);
}

// ---- panics -----------------------------------------------------------------------------------

#[test]
fn a_panicking_kernel_makes_synchronize_panic_with_its_message() {
    let dev = device(1 << 16);
    let buf = dev.alloc(16).unwrap();
    dev.launch(Box::new(|_| panic!("boom {}", 42)));
    // Work after the panic still runs, and events after it are still signalled.
    let after = Arc::new(AtomicBool::new(false));
    let a = Arc::clone(&after);
    dev.launch(Box::new(move |_| a.store(true, Ordering::SeqCst)));
    let e = Event::new();
    dev.record(Queue::Compute, &e);
    dev.wait(Queue::D2H, &e);
    let err = panic::catch_unwind(AssertUnwindSafe(|| dev.synchronize())).unwrap_err();
    let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.starts_with("device work panicked: boom 42"), "{msg}");
    assert!(after.load(Ordering::SeqCst));
    // Reported once; the device stays usable.
    dev.synchronize();
    assert_eq!(download_now(&dev, buf), vec![0.0; 16]);
    drop(dev);
}

#[test]
fn an_out_of_range_view_is_reported_by_synchronize() {
    let dev = device(1 << 12); // 1024 elements
    dev.launch(Box::new(|v| {
        let _ = v.buf(DevBuf { off: 1000, len: 100 });
    }));
    let err = panic::catch_unwind(AssertUnwindSafe(|| dev.synchronize())).unwrap_err();
    let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("outside the device pool"), "{msg}");
}

#[test]
fn drop_runs_queued_work_and_does_not_panic_on_a_pending_message() {
    let dev = device(1 << 12);
    let done = Arc::new(AtomicBool::new(false));
    let d = Arc::clone(&done);
    dev.launch(Box::new(|_| panic!("never synchronized")));
    dev.host(Box::new(move || {
        std::thread::sleep(Duration::from_millis(10));
        d.store(true, Ordering::SeqCst);
    }));
    drop(dev);
    assert!(done.load(Ordering::SeqCst));
}

#[test]
fn staging_is_zeroed_host_memory() {
    let dev = device(64);
    let s = dev.alloc_staging::<f32>(33);
    assert_eq!(s, vec![0.0; 33]);
    assert_eq!(dev.alloc_staging::<Bf16>(5), vec![Bf16(0); 5]);
    assert_eq!(dev.name(), "cpu");
}

#[test]
fn weights_upload_exactly_at_their_offset() {
    let dev = device(1 << 16);
    let b = dev.alloc(40).unwrap();
    upload_now(&dev, b, &[9.0; 40]);
    let w: Vec<f32> = (0..7).map(|i| 1.0 + i as f32 * 0.123_456_7).collect();
    // SAFETY: `w` outlives the synchronize in `download_now`.
    dev.upload_weights(b, 5, unsafe { HostPtr::new(&w) });
    let got = download_now(&dev, b);
    assert_eq!(&got[5..12], &w[..], "fp32 weights are copied exactly");
    assert!(got[..5].iter().chain(&got[12..]).all(|&x| x == 9.0), "{got:?}");
}

#[test]
fn bf16_weights_upload_expanded_exactly_at_their_offset_two_bytes_each() {
    let dev = device(1 << 16);
    let b = dev.alloc(40).unwrap();
    upload_now(&dev, b, &[9.0; 40]);
    let w: Vec<Bf16> = [1.0, -0.0, 3.5e-3, -7.25e20, 1e-40, f32::INFINITY, 0.1]
        .iter()
        .map(|&x| Bf16::from_f32(x))
        .collect();
    let before = dev.stats().h2d_bytes;
    // SAFETY: `w` outlives the synchronize in `download_now`.
    dev.upload_weights_bf16(b, 5, unsafe { HostPtr::new(&w) });
    let got = download_now(&dev, b);
    assert_eq!(dev.stats().h2d_bytes - before, 2 * 7, "the wire carries bf16");
    let want: Vec<u32> = w.iter().map(|x| x.to_f32().to_bits()).collect();
    let got_bits: Vec<u32> = got[5..12].iter().map(|x| x.to_bits()).collect();
    assert_eq!(got_bits, want, "bf16 weights are expanded exactly");
    assert!(got[..5].iter().chain(&got[12..]).all(|&x| x == 9.0), "{got:?}");
}

#[test]
fn bf16_download_rounds_on_the_wire_and_counts_two_bytes_per_element() {
    let dev = device(1 << 16);
    let b = dev.alloc(1001).unwrap();
    let x: Vec<f32> = (0..1001).map(|i| (i as f32 * 0.731).sin() * 7.0).collect();
    upload_now(&dev, b, &x);
    let before = dev.stats().d2h_bytes;
    let mut out = vec![Bf16(0x7fc1); 1001];
    // SAFETY: `out` is not touched until the synchronize below has run the download.
    dev.download_bf16(unsafe { HostPtrMut::new(&mut out) }, b);
    dev.synchronize();
    assert_eq!(dev.stats().d2h_bytes - before, 2 * 1001);
    for (i, (o, x)) in out.iter().zip(&x).enumerate() {
        assert_eq!(*o, Bf16::from_f32(*x), "element {i}");
    }
}
