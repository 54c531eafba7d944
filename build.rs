//! Compiles the C++ shim (`src/shim/*.cpp`) against the libtorch that torch-sys links, and
//! emits an rpath so tests, examples and binaries run without `LD_LIBRARY_PATH`.
//!
//! CUDA: when the libtorch lib dir holds `libtorch_cuda.so` (a CUDA build, such as the PyPI
//! wheel), every binary of this crate (tests, examples, benches) is linked with
//! `-Wl,--no-as-needed -ltorch_cuda -ltorch -Wl,--as-needed`. Nothing in tch or tch-amp
//! references a symbol of `libtorch_cuda.so` directly, so the linker's default `--as-needed`
//! drops it, the CUDA backend is never loaded, and `tch::Cuda::is_available()` is false on a
//! GPU machine. torch-sys's own link lines cannot fix that, and rust-lld (rustc's default
//! linker on x86_64 Linux) rejects tch-rs's usual `--copy-dt-needed-entries`. `tests/linking.rs`
//! fails when a test binary does not list `libtorch_cuda.so` as needed while the libtorch has it.
//!
//! Link arguments do not reach dependents' binaries: tch-amp exports `DEP_TCH_AMP_LIBTORCH_LIB`
//! (the lib dir) and `DEP_TCH_AMP_TORCH_CUDA` (`1` for a CUDA libtorch, else `0`) so a
//! dependent's build.rs emits the same rpath and link arguments (README, "Using tch-amp from
//! another crate").
use std::env;
use std::path::{Path, PathBuf};

const TORCH_VERSION: &str = "2.13.0";

fn torch_version(torch_dir: &Path) -> Option<String> {
    if let Ok(text) = std::fs::read_to_string(torch_dir.join("version.py")) {
        let line = text.lines().find(|l| l.starts_with("__version__"))?;
        let v = line.split(['\'', '"']).nth(1)?;
        return Some(v.split('+').next()?.to_string());
    }
    let text = std::fs::read_to_string(torch_dir.join("build-version")).ok()?;
    Some(text.trim().split('+').next()?.to_string())
}

/// Header folders for the `nccl` feature: `TCH_AMP_CUDA_INCLUDE` (a path list) first, then the
/// nvidia-* wheels beside torch (CUDA 13 layout: nvidia/cu13/include with crt/ and cccl/, and
/// nvidia/nccl/include). Stops the build with a message when a needed header is missing.
fn nccl_include_dirs(torch_dir: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> =
        env::var_os("TCH_AMP_CUDA_INCLUDE").map(|v| env::split_paths(&v).collect()).unwrap_or_default();
    if let Some(site) = torch_dir.parent() {
        let nv = site.join("nvidia");
        for d in ["cu13/include", "cu13/include/cccl", "nccl/include", "cuda_runtime/include"] {
            dirs.push(nv.join(d));
        }
    }
    dirs.retain(|d| d.is_dir());
    for header in ["cuda_runtime.h", "crt/host_config.h", "cuda/std/chrono", "nccl.h"] {
        if !dirs.iter().any(|d| d.join(header).is_file()) {
            panic!(
                "tch-amp: feature `nccl` needs {header}: `pip install nvidia-cuda-crt nvidia-cuda-cccl` (the CUDA \
                 version of your torch wheel) into torch's Python environment, or set TCH_AMP_CUDA_INCLUDE to the \
                 folders holding the CUDA runtime, crt, cccl and NCCL headers"
            );
        }
    }
    dirs
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/shim");
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    // torch-sys is a direct dependency with `links = "tch"`: it hands us its libtorch lib dir.
    let lib_dir = PathBuf::from(env::var("DEP_TCH_LIBTORCH_LIB").unwrap_or_else(|_| {
        panic!("tch-amp: torch-sys did not export DEP_TCH_LIBTORCH_LIB; run `make setup` or set LIBTORCH")
    }));
    let torch_dir = lib_dir.parent().expect("libtorch lib dir has a parent").to_path_buf();
    if env::var_os("LIBTORCH_BYPASS_VERSION_CHECK").is_none() {
        if let Some(found) = torch_version(&torch_dir) {
            if found != TORCH_VERSION {
                panic!(
                    "tch-amp: tch 0.26.0 needs libtorch {TORCH_VERSION}, found {found} at {}; \
                     run `make setup` (installs torch=={TORCH_VERSION} from PyPI) or point LIBTORCH at libtorch {TORCH_VERSION}",
                    torch_dir.display()
                );
            }
        }
    }
    let abi = env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_string());
    let mut sources: Vec<PathBuf> = std::fs::read_dir("src/shim")
        .expect("src/shim exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cpp"))
        .collect();
    sources.sort();
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .std("c++17")
        .include(torch_dir.join("include"))
        .include(torch_dir.join("include/torch/csrc/api/include"))
        // Declaration-only gloo stand-ins for ProcessGroupGloo.hpp (src/shim/gloo_stub/README.md).
        .include("src/shim/gloo_stub")
        .define("_GLIBCXX_USE_CXX11_ABI", abi.as_str())
        .define("GLOG_USE_GLOG_EXPORT", None)
        // libtorch's release build: some classes (RecordFunction) have debug-only fields, so the
        // shim must see the layout libtorch was built with.
        .define("NDEBUG", None)
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .flag_if_supported("-Wno-c++20-extensions")
        .files(&sources);
    // Feature `nccl`: the NCCL backend (src/shim/nccl/), against the CUDA, crt, cccl and NCCL headers.
    println!("cargo:rerun-if-env-changed=TCH_AMP_CUDA_INCLUDE");
    if env::var_os("CARGO_FEATURE_NCCL").is_some() {
        build
            .includes(nccl_include_dirs(&torch_dir))
            .define("TCH_AMP_NCCL", None)
            .flag_if_supported("-Wno-interference-size")
            .file("src/shim/nccl/distributed_nccl.cpp");
    }
    build.compile("tch_amp_shim");
    // Tests, examples and benches of this crate find libtorch without LD_LIBRARY_PATH.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    // Keep the CUDA backend as a needed library (see the crate doc above). The search path is
    // torch-sys's `rustc-link-search`; `--as-needed` is restored for whatever rustc adds after.
    let torch_cuda = lib_dir.join("libtorch_cuda.so").exists();
    if torch_cuda {
        for arg in ["-Wl,--no-as-needed", "-ltorch_cuda", "-ltorch", "-Wl,--as-needed"] {
            println!("cargo:rustc-link-arg={arg}");
        }
    }
    // Dependents read these as DEP_TCH_AMP_LIBTORCH_LIB and DEP_TCH_AMP_TORCH_CUDA to emit the
    // same rpath and link arguments.
    println!("cargo:libtorch_lib={}", lib_dir.display());
    println!("cargo:torch_cuda={}", u8::from(torch_cuda));
}
