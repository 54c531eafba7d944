//! Fashion-MNIST, or any image/label set in the IDX format of MNIST, read from gzip (or
//! plain) IDX files with flate2. Every problem with a file (missing, not gzip, wrong magic,
//! truncated, counts that disagree) is a [`DataError`] that names the file and says what was
//! expected; nothing here panics on bad input.
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};

/// Where Debian's `dataset-fashion-mnist` package puts the four files.
pub const DEFAULT_DATA_DIR: &str = "/usr/share/datasets/fashion-mnist";

/// The four files of a data set, without the `.gz` suffix (both forms are accepted).
pub const TRAIN_IMAGES: &str = "train-images-idx3-ubyte";
/// Training labels.
pub const TRAIN_LABELS: &str = "train-labels-idx1-ubyte";
/// Test images.
pub const TEST_IMAGES: &str = "t10k-images-idx3-ubyte";
/// Test labels.
pub const TEST_LABELS: &str = "t10k-labels-idx1-ubyte";

/// IDX magic of a file of unsigned bytes with `dims` dimensions.
const fn idx_magic(dims: u8) -> u32 {
    0x0000_0800 | dims as u32
}

/// A data file that could not be used: which file, and what was wrong with it.
#[derive(Debug)]
pub struct DataError {
    /// The file.
    pub path: PathBuf,
    /// What was expected and what was found.
    pub problem: String,
}

impl fmt::Display for DataError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.problem)
    }
}

impl std::error::Error for DataError {}

fn err(path: &Path, problem: impl Into<String>) -> DataError {
    DataError { path: path.to_path_buf(), problem: problem.into() }
}

/// The contents of one IDX file of unsigned bytes.
#[derive(Debug)]
pub struct Idx {
    /// The dimensions the header announces.
    pub dims: Vec<usize>,
    /// `dims.iter().product()` bytes.
    pub data: Vec<u8>,
}

/// Reads an IDX file of unsigned bytes with `ndims` dimensions, gunzipping it when it starts
/// with the gzip magic.
///
/// # Errors
/// A [`DataError`] naming `path` when it cannot be read, is a broken gzip stream, has another
/// magic number (type or number of dimensions), or holds fewer or more data bytes than its
/// header announces.
pub fn read_idx(path: &Path, ndims: u8) -> Result<Idx, DataError> {
    let raw = std::fs::read(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            err(path, "file not found")
        } else {
            err(path, format!("cannot read: {e}"))
        }
    })?;
    let bytes = if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(|e| err(path, format!("broken gzip stream ({e}); expected a gzip-compressed IDX file")))?;
        out
    } else {
        raw
    };
    let magic_expected = idx_magic(ndims);
    let what = format!("IDX magic 0x{magic_expected:08x} (unsigned bytes, {ndims} dimensions)");
    if bytes.len() < 4 {
        return Err(err(path, format!("truncated: {} bytes, expected at least the 4-byte {what}", bytes.len())));
    }
    let magic = u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
    if magic != magic_expected {
        return Err(err(path, format!("bad magic number 0x{magic:08x}, expected {what}")));
    }
    let header = 4 + 4 * ndims as usize;
    if bytes.len() < header {
        return Err(err(
            path,
            format!("truncated header: {} bytes, expected {header} (magic and {ndims} dimension sizes)", bytes.len()),
        ));
    }
    let dims: Vec<usize> = bytes[4..header]
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
        .collect();
    let expected = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let Some(expected) = expected else {
        return Err(err(path, format!("dimensions {dims:?} are too large")));
    };
    let found = bytes.len() - header;
    if found < expected {
        return Err(err(
            path,
            format!("truncated: the header announces dimensions {dims:?} = {expected} data bytes, found {found}"),
        ));
    }
    if found > expected {
        return Err(err(
            path,
            format!(
                "{} unexpected bytes after the {expected} data bytes the header announces (dimensions {dims:?})",
                found - expected
            ),
        ));
    }
    Ok(Idx { dims, data: bytes[header..].to_vec() })
}

/// Images of an IDX3 file as a `[N, 1, H, W]` f32 tensor with values in [0, 1].
///
/// # Errors
/// As [`read_idx`]; also an image size of zero.
pub fn load_images(path: &Path) -> Result<Tensor, DataError> {
    let idx = read_idx(path, 3)?;
    let (n, h, w) = (idx.dims[0], idx.dims[1], idx.dims[2]);
    if h == 0 || w == 0 {
        return Err(err(path, format!("images of size {h}x{w}: expected non-empty images")));
    }
    let t = Tensor::from_slice(&idx.data).view([n as i64, 1, h as i64, w as i64]);
    Ok(t.to_kind(Kind::Float) / 255.0)
}

/// Labels of an IDX1 file as an i64 tensor `[N]`.
///
/// # Errors
/// As [`read_idx`].
pub fn load_labels(path: &Path) -> Result<Tensor, DataError> {
    let idx = read_idx(path, 1)?;
    Ok(Tensor::from_slice(&idx.data).to_kind(Kind::Int64))
}

/// Images `[N, 1, H, W]` (f32) and their labels `[N]` (i64).
#[derive(Debug)]
pub struct Split {
    /// Images.
    pub images: Tensor,
    /// Labels, `0..num_classes`.
    pub labels: Tensor,
}

impl Split {
    /// Number of examples.
    pub fn len(&self) -> usize {
        self.labels.size()[0] as usize
    }

    /// Whether the split is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first `n` examples (all when `n` is 0 or at least the length).
    pub fn head(&self, n: usize) -> Split {
        let n = if n == 0 { self.len() } else { n.min(self.len()) } as i64;
        Split { images: self.images.narrow(0, 0, n), labels: self.labels.narrow(0, 0, n) }
    }

    /// `n` examples drawn without replacement by a permutation seeded with `seed` (all, in
    /// file order, when `n` is 0 or at least the length), so that a subset of a file sorted
    /// by class still holds every class.
    pub fn subset(&self, n: usize, seed: u64) -> Split {
        if n == 0 || n >= self.len() {
            return self.head(0);
        }
        let mut order = super::train::permutation(self.len(), seed);
        order.truncate(n);
        order.sort_unstable();
        let idx = Tensor::from_slice(&order);
        Split { images: self.images.index_select(0, &idx), labels: self.labels.index_select(0, &idx) }
    }

    /// The batch of `indices`.
    pub fn batch(&self, indices: &[i64]) -> (Tensor, Tensor) {
        let idx = Tensor::from_slice(indices);
        (self.images.index_select(0, &idx), self.labels.index_select(0, &idx))
    }
}

/// A data set as read from its four IDX files.
#[derive(Debug)]
pub struct Dataset {
    /// The 60,000 training examples of Fashion-MNIST.
    pub train: Split,
    /// The 10,000 test examples.
    pub test: Split,
    /// One more than the largest label.
    pub num_classes: i64,
}

/// `dir/name.gz`, else `dir/name`; the `.gz` path when neither exists (for the message).
fn locate(dir: &Path, name: &str) -> PathBuf {
    let gz = dir.join(format!("{name}.gz"));
    let plain = dir.join(name);
    if !gz.exists() && plain.exists() {
        plain
    } else {
        gz
    }
}

fn load_split(dir: &Path, images: &str, labels: &str) -> Result<Split, DataError> {
    let (ipath, lpath) = (locate(dir, images), locate(dir, labels));
    let images = load_images(&ipath)?;
    let labels = load_labels(&lpath)?;
    let (ni, nl) = (images.size()[0], labels.size()[0]);
    if ni != nl {
        return Err(err(&lpath, format!("{nl} labels, expected one per image of {} ({ni} images)", ipath.display())));
    }
    if ni == 0 {
        return Err(err(&ipath, "no images: expected at least one"));
    }
    Ok(Split { images, labels })
}

impl Dataset {
    /// Loads the four files (`train-images-idx3-ubyte[.gz]`, ...) of `dir`.
    ///
    /// # Errors
    /// A [`DataError`] naming the first bad file. A missing file's message says how to get
    /// Fashion-MNIST (`make data`) or to pass `--data DIR`.
    pub fn load(dir: &Path) -> Result<Self, DataError> {
        let hint = |mut e: DataError| {
            if e.problem == "file not found" {
                e.problem = format!(
                    "file not found; expected the gzip IDX files of Fashion-MNIST ({TRAIN_IMAGES}.gz, \
                     {TRAIN_LABELS}.gz, {TEST_IMAGES}.gz, {TEST_LABELS}.gz) in {}: install them with \
                     `make data` (Debian package dataset-fashion-mnist) or pass --data DIR",
                    dir.display()
                );
            }
            e
        };
        let train = load_split(dir, TRAIN_IMAGES, TRAIN_LABELS).map_err(hint)?;
        let test = load_split(dir, TEST_IMAGES, TEST_LABELS).map_err(hint)?;
        let (a, b) = (train.images.size(), test.images.size());
        if a[2..] != b[2..] {
            return Err(err(
                &locate(dir, TEST_IMAGES),
                format!("images of {}x{}, expected the training images' {}x{}", b[2], b[3], a[2], a[3]),
            ));
        }
        let max = |s: &Split| s.labels.max().int64_value(&[]);
        let num_classes = max(&train).max(max(&test)) + 1;
        Ok(Self { train, test, num_classes })
    }

    /// Mean and standard deviation of the training images' pixels.
    pub fn mean_std(&self) -> (f64, f64) {
        let x = &self.train.images;
        (x.mean(Kind::Float).double_value(&[]), x.std(true).double_value(&[]))
    }

    /// Standardises both splits with the training set's mean and standard deviation.
    pub fn standardize(mut self) -> Self {
        let (mean, std) = self.mean_std();
        let std = if std > 0.0 { std } else { 1.0 };
        self.train.images = (&self.train.images - mean) / std;
        self.test.images = (&self.test.images - mean) / std;
        self
    }

    /// Image height and width.
    pub fn image_size(&self) -> (i64, i64) {
        let s = self.train.images.size();
        (s[2], s[3])
    }
}

/// Writes an IDX file of unsigned bytes (gzip-compressed when `gzip`); for tests and for
/// making small data sets.
///
/// # Errors
/// I/O errors.
pub fn write_idx(path: &Path, dims: &[usize], data: &[u8], gzip: bool) -> std::io::Result<()> {
    use std::io::Write;
    let mut bytes = idx_magic(dims.len() as u8).to_be_bytes().to_vec();
    for &d in dims {
        bytes.extend_from_slice(&(d as u32).to_be_bytes());
    }
    bytes.extend_from_slice(data);
    if gzip {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        enc.write_all(&bytes)?;
        bytes = enc.finish()?;
    }
    std::fs::write(path, bytes)
}

/// Writes a small synthetic data set in the layout of Fashion-MNIST (four gzip IDX files)
/// to `dir`: `classes` classes of `size`x`size` images, each class a bright bar at its own
/// position plus seeded noise, so that a small CNN learns it in a few steps.
///
/// # Errors
/// I/O errors.
pub fn write_synthetic(dir: &Path, train: usize, test: usize, classes: u8, size: usize, seed: u64) -> std::io::Result<()> {
    let mut rng = super::train::SplitMix64::new(seed);
    let mut make = |n: usize| {
        let mut images = vec![0u8; n * size * size];
        let mut labels = vec![0u8; n];
        for i in 0..n {
            let c = (rng.next_u64() % classes as u64) as u8;
            labels[i] = c;
            let img = &mut images[i * size * size..(i + 1) * size * size];
            for (j, px) in img.iter_mut().enumerate() {
                let (r, col) = (j / size, j % size);
                let band = (c as usize * size) / classes as usize;
                let on = if c % 2 == 0 { r >= band && r < band + 3 } else { col >= band && col < band + 3 };
                let noise = (rng.next_u64() % 64) as u8;
                *px = if on { 190 + noise } else { noise };
            }
        }
        (images, labels)
    };
    let (ti, tl) = make(train);
    let (vi, vl) = make(test);
    write_idx(&dir.join(format!("{TRAIN_IMAGES}.gz")), &[train, size, size], &ti, true)?;
    write_idx(&dir.join(format!("{TRAIN_LABELS}.gz")), &[train], &tl, true)?;
    write_idx(&dir.join(format!("{TEST_IMAGES}.gz")), &[test, size, size], &vi, true)?;
    write_idx(&dir.join(format!("{TEST_LABELS}.gz")), &[test], &vl, true)?;
    Ok(())
}
