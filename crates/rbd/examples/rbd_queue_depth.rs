//! rbd_queue_depth: how many 4 KiB random writes (or reads) per second one queue gets from an
//! RBD image through librbd's asynchronous calls (`RbdEngine`, what `serve` uses) against the
//! block crate's `Pipeline::synchronous` (librbd's synchronous calls on the I/O thread pool, the generic
//! path for devices without an engine of their own), at the same depth, rounds interleaved.
//!
//! ```text
//! cargo run --release -p cryptblk-rbd --example rbd_queue_depth -- rbd:rbd/IMAGE[:conf=PATH] \
//!     [--read] [--depth 32] [--seconds 5] [--rounds 3]
//! ```
//! The image is written over its first 256 MiB (reads: fill it first with a write run).

use cryptblk_block::aio::{IoBuffers, IoQueue, IoRequest, OwnedBuffer, Pipeline, QueueOptions};

use cryptblk_block::open_queue;
use cryptblk_block::BlockDevice;
use cryptblk_rbd::{Image, OpenMode, RbdDevice, RbdSpec};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn run(queue: &mut dyn IoQueue, read: bool, depth: usize, time: Duration) -> f64 {
    const BLOCK: usize = 4096;
    let area = (256u64 << 20) / BLOCK as u64;
    let iovs: Vec<IoBuffers> = (0..depth)
        .map(|_| IoBuffers::whole(Arc::new(OwnedBuffer::from_bytes(&[0x5a; BLOCK])), BLOCK))
        .collect::<Result<_, _>>()
        .unwrap();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % area) * BLOCK as u64
    };
    let mut push = |q: &mut dyn IoQueue, slot: usize| {
        let req = if read {
            IoRequest::read(next(), &iovs[slot], slot as u64)
        } else {
            IoRequest::write(next(), &iovs[slot], false, slot as u64)
        };
        q.push(&req).unwrap();
    };
    let start = Instant::now();
    for slot in 0..depth {
        push(queue, slot);
    }
    queue.submit().unwrap();
    let mut done = 0u64;
    let mut free = Vec::with_capacity(depth);
    while queue.in_flight() > 0 {
        queue.wait();
        queue.drain(&mut |c| {
            c.result.unwrap();
            done += 1;
            free.push(c.tag as usize);
        });
        if start.elapsed() < time {
            for slot in free.drain(..) {
                push(queue, slot);
            }
            queue.submit().unwrap();
        }
        free.clear();
    }
    done as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let name = args.next().expect(
        "usage: rbd_queue_depth rbd:POOL/IMAGE [--read] [--depth N] [--seconds S] [--rounds N]",
    );
    let (mut read, mut depth, mut seconds, mut rounds) = (false, 32usize, 5u64, 3usize);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--read" => read = true,
            "--depth" => depth = args.next().unwrap().parse().unwrap(),
            "--seconds" => seconds = args.next().unwrap().parse().unwrap(),
            "--rounds" => rounds = args.next().unwrap().parse().unwrap(),
            other => panic!("unknown option {other}"),
        }
    }
    let spec = RbdSpec::parse(&name).unwrap();
    let device: Arc<dyn BlockDevice> = Arc::new(RbdDevice::new(
        Image::open(&spec, OpenMode::ReadWrite).unwrap(),
    ));
    let time = Duration::from_secs(seconds);
    let mut ratios = Vec::new();
    for round in 1..=rounds {
        // The device's own queue runs on an RbdEngine.
        let mut aio = open_queue(&device, &QueueOptions { depth }).unwrap();
        let a = run(&mut *aio, read, depth, time);
        drop(aio);
        let mut sync = Pipeline::synchronous(device.clone(), &QueueOptions { depth }).unwrap();
        let s = run(&mut sync, read, depth, time);
        println!(
            "round {round}: {} depth {depth}: librbd aio {a:.0} IOPS, synchronous {s:.0} IOPS, ratio {:.2}",
            if read { "4k randread" } else { "4k randwrite" },
            a / s
        );
        ratios.push(a / s);
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "median ratio librbd aio/synchronous: {:.2}",
        ratios[ratios.len() / 2]
    );
}
