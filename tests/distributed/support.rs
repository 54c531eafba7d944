//! Multi-process harness for the distributed tests: the test process is rank 0 and re-runs its
//! own binary, filtered to the same test, as ranks 1.. (`TCH_AMP_TEST_RANK`). All run the same
//! body; a free loopback port per test; the peers are killed if rank 0 fails, and waited for
//! with a bound.
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tch::nn::{self, VarStore};
use tch::Tensor;
use tch_amp::distributed::{InitOptions, ProcessGroup};

/// Set in the re-run test binary: the rank it plays.
pub const RANK_ENV: &str = "TCH_AMP_TEST_RANK";
/// Set in the re-run test binary: the number of ranks.
pub const WORLD_ENV: &str = "TCH_AMP_TEST_WORLD";
/// Set in the re-run test binary: the TCPStore port.
pub const PORT_ENV: &str = "TCH_AMP_TEST_PORT";
/// Set in the re-run test binary: a folder both ranks may use (rank 0 removes it at the end).
pub const DIR_ENV: &str = "TCH_AMP_TEST_DIR";
/// Bound on every rendezvous and collective of the tests.
pub const TIMEOUT: Duration = Duration::from_secs(20);
/// Bound on the peer process's whole run.
pub const PEER_DEADLINE: Duration = Duration::from_secs(90);

/// Serializes the tests of this binary that seed and draw from libtorch's global generator
/// (`manual_seed` then `randn`): the test harness runs tests on several threads of one
/// process, and a seed set on one thread would otherwise be consumed by another's draws (the
/// two ranks then still agree with each other, but not with the one-process reference).
pub fn global_rng_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    l.local_addr().expect("local addr").port()
}

/// The peer process; killed (and reaped) when dropped unless it was waited for.
pub struct Peer {
    child: Option<Child>,
}

impl Peer {
    /// Starts `cmd` as the peer.
    pub fn spawn(cmd: &mut Command) -> Self {
        Self { child: Some(cmd.stdin(Stdio::null()).spawn().expect("spawn the peer")) }
    }

    /// Kills the peer now (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits for the peer to exit (at most `deadline`, then kills it) and asserts it passed.
    pub fn expect_success(&mut self, deadline: Duration) {
        let Some(mut c) = self.child.take() else { return };
        let start = Instant::now();
        loop {
            match c.try_wait().expect("try_wait") {
                Some(status) => {
                    assert!(status.success(), "a peer rank failed: {status}");
                    return;
                }
                None if start.elapsed() > deadline => {
                    let _ = c.kill();
                    let _ = c.wait();
                    panic!("a peer rank did not finish within {deadline:?}");
                }
                None => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Which rank of a multi-rank test this process is.
pub struct Side {
    /// 0 .. world.
    pub rank: usize,
    /// The number of ranks.
    pub world: usize,
    /// The TCPStore port.
    pub port: u16,
    /// On rank 0: the peer processes (ranks 1.. in order).
    pub peers: Vec<Peer>,
    /// A folder shared by the ranks for this test (deleted by rank 0 afterwards).
    pub dir: std::path::PathBuf,
}

impl Side {
    /// Joins the group on 127.0.0.1 (Gloo, [`TIMEOUT`]).
    pub fn group(&self) -> ProcessGroup {
        ProcessGroup::init(&InitOptions::new(self.rank, self.world, "127.0.0.1", self.port).timeout(TIMEOUT))
            .expect("rendezvous")
    }
}

/// Runs `body` on two ranks: here as rank 0, and in a re-run of this test binary (only the test
/// `name`) as rank 1. On rank 0, returns after rank 1 has exited successfully.
///
/// `name` is the test's path as `concat!(module_path!(), "::test_name")` gives it; the crate
/// name in front is dropped to get the name libtest filters on.
pub fn two_ranks(name: &str, body: impl FnOnce(&mut Side)) {
    ranks(2, name, body)
}

/// [`two_ranks`] with `world` ranks: ranks 1.. are re-runs of this test binary.
pub fn ranks(world: usize, name: &str, body: impl FnOnce(&mut Side)) {
    let name = name.split_once("::").map_or(name, |(_, rest)| rest);
    let _rng = global_rng_lock();
    tch::set_num_threads(1);
    if let Ok(r) = std::env::var(RANK_ENV) {
        let port = std::env::var(PORT_ENV).expect("port").parse().expect("port number");
        let world = std::env::var(WORLD_ENV).expect("world size").parse().expect("world size");
        let dir = std::env::var(DIR_ENV).expect("shared folder").into();
        let mut side = Side { rank: r.parse().expect("rank"), world, port, peers: Vec::new(), dir };
        body(&mut side);
        return;
    }
    let port = free_port();
    let dir = tempfile::tempdir().expect("a temporary folder");
    // The peers' libtest lines stay out of this test's output; their panics (stderr) show.
    let peers = (1..world)
        .map(|rank| {
            Peer::spawn(
                Command::new(std::env::current_exe().expect("test binary"))
                    .args([name, "--exact", "--nocapture", "--test-threads=1"])
                    .env(RANK_ENV, rank.to_string())
                    .env(WORLD_ENV, world.to_string())
                    .env(PORT_ENV, port.to_string())
                    .env(DIR_ENV, dir.path())
                    .stdout(Stdio::null()),
            )
        })
        .collect();
    let mut side = Side { rank: 0, world, port, peers, dir: dir.path().to_path_buf() };
    body(&mut side);
    for peer in &mut side.peers {
        peer.expect_success(PEER_DEADLINE);
    }
}

/// Every rank's copy of `t` (same shape everywhere).
pub fn gathered(pg: &ProcessGroup, t: &Tensor) -> Vec<Tensor> {
    pg.all_gather(t).expect("all_gather")
}

/// Asserts `t` has the same bits on every rank.
pub fn assert_same_on_all_ranks(pg: &ProcessGroup, t: &Tensor, what: &str) {
    let all = gathered(pg, t);
    for (r, x) in all.iter().enumerate() {
        assert!(x.equal(&all[0]), "{what}: rank {r} differs from rank 0");
    }
}

/// The model of the Python peers (tests/fixtures/dist_*_rank.py: an `nn.Sequential` of three
/// linears, 8-32-16-4, relu and tanh between): names as torch's.
pub fn torch_net(vs: &VarStore) -> nn::SequentialT {
    let p = vs.root();
    nn::seq_t()
        .add(nn::linear(&p / "0", 8, 32, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&p / "2", 32, 16, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&p / "4", 16, 4, Default::default()))
}
