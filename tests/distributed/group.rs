//! The process group on two processes over 127.0.0.1 (Gloo): exact collective results, typed
//! errors for a peer that never comes or dies, torch's DistributedSampler indices.

use std::time::{Duration, Instant};

use tch::{Device, Kind, Tensor};
use tch_amp::distributed::{DistError, DistributedSampler, InitOptions, ProcessGroup, ReduceOp};

use crate::support::{free_port, two_ranks, Side};

fn f32s(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(&t.to_kind(Kind::Float).flatten(0, -1)).unwrap()
}

/// Rank r holds [r+1, 10(r+1), -r, 0.5] (f32): sum, avg, max, min, product are exact.
#[test]
fn allreduce_sum_avg_max_exact_values() {
    two_ranks(concat!(module_path!(), "::allreduce_sum_avg_max_exact_values"), |side: &mut Side| {
        let pg = side.group();
        assert_eq!((pg.rank(), pg.world_size()), (side.rank, 2));
        let r = side.rank as f32;
        let base = || Tensor::from_slice(&[r + 1.0, 10.0 * (r + 1.0), -r, 0.5f32]);
        let cases: [(ReduceOp, [f32; 4]); 5] = [
            (ReduceOp::Sum, [3.0, 30.0, -1.0, 1.0]),
            (ReduceOp::Avg, [1.5, 15.0, -0.5, 0.5]),
            (ReduceOp::Max, [2.0, 20.0, 0.0, 0.5]),
            (ReduceOp::Min, [1.0, 10.0, -1.0, 0.5]),
            (ReduceOp::Product, [2.0, 200.0, 0.0, 0.25]),
        ];
        for (op, want) in cases {
            let mut t = base();
            pg.all_reduce_(&mut t, op).unwrap();
            let got = f32s(&t);
            assert_eq!(got[..2], want[..2], "{op:?}");
            assert_eq!(got[3], want[3], "{op:?}");
            assert_eq!(got[2].abs(), want[2].abs(), "{op:?}"); // -0 vs 0 for the product
        }
        // Several tensors in flight together, int64 sum.
        let mut many =
            vec![Tensor::from_slice(&[side.rank as i64 + 5]), Tensor::ones([2, 3], (Kind::Float, Device::Cpu))];
        pg.all_reduce_many_(&mut many, ReduceOp::Sum).unwrap();
        assert_eq!(many[0].int64_value(&[0]), 11);
        assert_eq!(f32s(&many[1]), vec![2.0; 6]);
        // Average of an integer tensor is refused with a typed error, on both ranks alike.
        let mut ints = Tensor::from_slice(&[1i64]);
        let err = pg.all_reduce_(&mut ints, ReduceOp::Avg).unwrap_err();
        assert!(matches!(err, DistError::Collective { .. }), "{err}");
        // Broadcast from rank 1, all_gather, barrier.
        let mut b = Tensor::from_slice(&[r * 7.0, 1.0]);
        pg.broadcast_(&mut b, 1).unwrap();
        assert_eq!(f32s(&b), vec![7.0, 1.0]);
        let g = pg.all_gather(&Tensor::from_slice(&[r, r * r + 1.0])).unwrap();
        assert_eq!(g.iter().map(f32s).collect::<Vec<_>>(), vec![vec![0.0, 1.0], vec![1.0, 2.0]]);
        pg.barrier().unwrap();
        let err = pg.broadcast_(&mut b, 2).unwrap_err();
        assert!(matches!(err, DistError::InvalidOption { option: "root", .. }), "{err}");
    });
}

/// World size 2, nobody else comes: a typed rendezvous error within the timeout.
#[test]
fn missing_peer_is_a_rendezvous_error_within_the_timeout() {
    let timeout = Duration::from_secs(2);
    let start = Instant::now();
    let err = ProcessGroup::init(&InitOptions::new(0, 2, "127.0.0.1", free_port()).timeout(timeout)).unwrap_err();
    let took = start.elapsed();
    eprintln!("no peer ({took:?}): {err}");
    assert!(matches!(err, DistError::Rendezvous { rank: 0, world_size: 2, .. }), "{err}");
    // Bounded: the 2 s timeout plus start-up, far from a hang.
    assert!(took < Duration::from_secs(30), "took {took:?}");
}

/// Rank 1 is killed (SIGKILL) after a barrier; rank 0's next collectives fail with a typed
/// peer error, within the timeout.
#[test]
fn killed_peer_gives_a_typed_error_within_the_timeout() {
    two_ranks(concat!(module_path!(), "::killed_peer_gives_a_typed_error_within_the_timeout"), |side: &mut Side| {
        let pg = side.group();
        pg.set_timeout(Duration::from_secs(5)).unwrap();
        pg.barrier().unwrap();
        if side.rank == 1 {
            // Wait to be killed (bounded, in case rank 0 is gone).
            std::thread::sleep(Duration::from_secs(60));
            return;
        }
        side.peers[0].kill();
        let start = Instant::now();
        let mut t = Tensor::ones([1000], (Kind::Float, Device::Cpu));
        let err = pg.all_reduce_(&mut t, ReduceOp::Sum).unwrap_err();
        let took = start.elapsed();
        eprintln!("rank 0 after the peer was killed ({took:?}): {err}");
        assert!(err.is_peer_failure(), "{err:?}");
        assert!(took < Duration::from_secs(30), "took {took:?}");
        let err = pg.barrier().unwrap_err();
        assert!(err.is_peer_failure(), "{err:?}");
        side.peers.clear();
    });
}

#[test]
fn env_init_reports_missing_variables() {
    // The test process has no torchrun environment unless a developer exported one.
    if std::env::var("RANK").is_err() {
        let err = InitOptions::from_env().unwrap_err();
        assert!(matches!(err, DistError::MissingEnv { var: "RANK" }), "{err}");
    }
    let err = ProcessGroup::init(&InitOptions::new(2, 2, "127.0.0.1", 1)).unwrap_err();
    assert!(matches!(err, DistError::InvalidOption { option: "rank", .. }), "{err}");
}

// Expected sequences from torch 2.13.0's DistributedSampler: scripts/dist_sampler_reference.py.
#[test]
fn sampler_matches_torch_distributed_sampler() {
    let idx = |len, rank, shuffle, seed, drop_last, epoch| {
        let mut s = DistributedSampler::new(len, 3, rank).unwrap().shuffle(shuffle).seed(seed).drop_last(drop_last);
        s.set_epoch(epoch);
        s.indices().unwrap()
    };
    // shuffle=False, padding 10 -> 12 by repeating the start.
    assert_eq!(idx(10, 0, false, 0, false, 0), vec![0, 3, 6, 9]);
    assert_eq!(idx(10, 1, false, 0, false, 0), vec![1, 4, 7, 0]);
    assert_eq!(idx(10, 2, false, 0, false, 0), vec![2, 5, 8, 1]);
    // drop_last cuts 10 -> 9.
    assert_eq!(idx(10, 2, false, 0, true, 0), vec![2, 5, 8]);
    // Padding longer than the data set (2 items, 3 replicas... 2 -> 3).
    assert_eq!(idx(2, 2, false, 0, false, 0), vec![0]);
    // drop_last with fewer items than replicas: torch's num_samples is ceil(-1/3) = 0.
    for rank in 0..3 {
        assert_eq!(idx(2, rank, false, 0, true, 0), Vec::<i64>::new());
        assert_eq!(idx(2, rank, true, 0, true, 0), Vec::<i64>::new());
    }
    assert_eq!(DistributedSampler::new(2, 3, 0).unwrap().drop_last(true).num_samples(), 0);
    for &(len, rank, seed, drop_last, epoch, want) in SHUFFLED {
        assert_eq!(
            idx(len, rank, true, seed, drop_last, epoch),
            want.to_vec(),
            "len {len} rank {rank} seed {seed} epoch {epoch}"
        );
    }
    let err = DistributedSampler::new(10, 2, 2).unwrap_err();
    assert!(matches!(err, DistError::InvalidOption { .. }), "{err}");
}

/// (len, rank, seed, drop_last, epoch, indices) for shuffle=True, num_replicas=3.
type Shuffled = (usize, usize, u64, bool, u64, &'static [i64]);
const SHUFFLED: &[Shuffled] = &[
    (10, 0, 0, false, 0, &[4, 5, 0, 2]),
    (10, 1, 0, false, 0, &[1, 3, 8, 4]),
    (10, 2, 0, false, 0, &[7, 9, 6, 1]),
    (10, 0, 0, false, 1, &[5, 2, 9, 4]),
    (10, 2, 7, true, 3, &[6, 5, 2]),
    (
        100,
        1,
        42,
        false,
        5,
        &[
            27, 44, 37, 71, 16, 46, 49, 76, 28, 65, 45, 64, 53, 92, 9, 61, 79, 63, 86, 73, 23, 60, 21, 30, 99, 78, 84,
            57, 50, 6, 54, 14, 22, 55,
        ],
    ),
    (2, 2, 1, false, 0, &[1]),
];
