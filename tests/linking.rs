//! How this crate's binaries are linked: with a CUDA libtorch, `libtorch_cuda.so` must be a
//! needed library of every binary, or libtorch never loads its CUDA backend and
//! `tch::Cuda::is_available()` is false on a GPU machine (build.rs, issue 14). This test
//! binary is one of those binaries: it reads its own ELF dynamic section and the libraries
//! the loader mapped, so it checks the link that cargo really made, wherever it runs (also a
//! binary built elsewhere and run with `LD_LIBRARY_PATH`).
use std::path::PathBuf;

/// The libraries mapped into this process, by full path, from `/proc/self/maps`.
fn mapped_libraries() -> Vec<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("read /proc/self/maps");
    let mut libs: Vec<PathBuf> = maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter(|path| path.starts_with('/') && path.contains(".so"))
        .map(PathBuf::from)
        .collect();
    libs.sort();
    libs.dedup();
    libs
}

/// The DT_NEEDED entries of this test binary.
fn needed_libraries() -> Vec<String> {
    let exe = std::fs::read("/proc/self/exe").expect("read /proc/self/exe");
    let elf = goblin::elf::Elf::parse(&exe).expect("this test binary is an ELF file");
    elf.libraries.iter().map(|s| s.to_string()).collect()
}

fn file_name(p: &std::path::Path) -> &str {
    p.file_name().and_then(|n| n.to_str()).unwrap_or("")
}

#[test]
fn binaries_need_libtorch_cuda_when_libtorch_has_it() {
    // Touch libtorch so the test cannot pass on a binary that dropped it altogether.
    let _ = tch::Tensor::from(1.0f32);
    let mapped = mapped_libraries();
    let cpu = mapped
        .iter()
        .find(|p| file_name(p) == "libtorch_cpu.so")
        .unwrap_or_else(|| panic!("libtorch_cpu.so is not mapped; mapped: {mapped:?}"));
    let lib_dir = cpu.parent().expect("libtorch_cpu.so has a folder");
    let has_cuda = lib_dir.join("libtorch_cuda.so").exists();
    let needed = needed_libraries();
    assert!(needed.iter().any(|n| n == "libtorch_cpu.so"), "needed: {needed:?}");
    let needs_cuda = needed.iter().any(|n| n == "libtorch_cuda.so");
    assert_eq!(
        needs_cuda,
        has_cuda,
        "{} has libtorch_cuda.so: {has_cuda}, but this binary lists it as needed: {needs_cuda} (needed: {needed:?}); \
         build.rs must link it with -Wl,--no-as-needed -ltorch_cuda",
        lib_dir.display()
    );
    // The loader followed the link: the CUDA backend sits in the same folder as libtorch_cpu.
    let cuda_mapped = mapped.iter().any(|p| p.parent() == Some(lib_dir) && file_name(p) == "libtorch_cuda.so");
    assert_eq!(cuda_mapped, has_cuda, "mapped: {mapped:?}");
}
