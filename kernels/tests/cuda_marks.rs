//! GPU timestamps (`Device::marks`, `Device::mark`): marks time the work queued between
//! them, in order from 0, and marks past the capacity are not recorded. Needs a GPU: runs
//! only with `TESSERA_GPU_TESTS=1`.
#![cfg(feature = "cuda")]

mod common;

use common::gpu::*;

use half::bf16;

#[test]
fn marks_time_the_work_between_them() {
    let Some(dev) = gpu("marks_time_the_work_between_them") else { return };
    // 512 MiB of bf16 written by the random fill: at least ~110 µs at the H200's 4.8 TB/s.
    let n = 256usize << 20;
    let mut buf = dev.alloc::<bf16>(n).unwrap();
    let mut marks = dev.marks(3).unwrap();
    assert!(marks.is_empty());
    dev.mark(&mut marks).unwrap();
    dev.fill_uniform(&mut buf, 1, -1.0, 1.0).unwrap();
    dev.mark(&mut marks).unwrap();
    dev.mark(&mut marks).unwrap();
    dev.mark(&mut marks).unwrap(); // past the capacity: not recorded
    assert_eq!(marks.len(), 3);
    let t = marks.times_us().unwrap();
    assert_eq!(t.len(), 3);
    assert_eq!(t[0], 0.0);
    let fill = t[1] - t[0];
    assert!(fill >= 50.0, "512 MiB written in {fill:.1} µs: faster than the memory allows");
    assert!(t[2] >= t[1], "marks out of order: {t:?}");
    assert!(t[2] - t[1] < fill, "nothing queued between the last two marks, yet {:.1} µs", t[2] - t[1]);
    eprintln!("fill of 512 MiB: {fill:.1} µs between marks; empty interval {:.1} µs", t[2] - t[1]);
}
