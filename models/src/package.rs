//! The package on disk: `DIR/<name>/manifest.json` + `DIR/<name>/weights.safetensors`.
//!
//! `weights.safetensors` is a standard safetensors file (every parameter in
//! the package's storage dtype, f32, f16 or bf16, with the framework's
//! names), loadable by any reader. The manifest adds the layer graph and the
//! packed layout (see [`crate::layout`]) with a checksum per group.
//!
//! Offsets and sizes in the manifest are in stored bytes. A device holds
//! every parameter as f32: its layout is the stored one scaled by
//! [`ParamDtype::widen_factor`] (see [`crate::dtype`]), given by the
//! `device_*` methods of [`Manifest`], [`ParamEntry`] and [`GroupEntry`].

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use distmind_common::checksum::{checksum, to_hex, Checksummer};
use distmind_common::limits::PARAM_ALIGN_BYTES;
use serde::{Deserialize, Serialize};

use crate::config::{Family, ModelConfig, Scale};
use crate::dtype::ParamDtype;
use crate::graph::{Architecture, Dtype, Layer, OutputSpec, TensorSpec};
use crate::layout::{self, align_up, Layout};
use crate::{shape, ModelError, Result};

/// Version of the manifest format written by this crate.
pub const FORMAT_VERSION: u32 = 1;
pub const MANIFEST_FILE: &str = "manifest.json";
pub const WEIGHTS_FILE: &str = "weights.safetensors";
/// Largest safetensors header accepted (bounded before allocation).
const SAFETENSORS_HEADER_BYTES_MAX: u64 = 100 << 20;

/// One parameter: where it lies in the packed layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamEntry {
    pub name: String,
    pub shape: Vec<usize>,
    /// The element type executors compute it in: always `F32`. How it is
    /// stored is the package's [`Manifest::param_dtype`].
    pub dtype: Dtype,
    /// Id of the layer that uses it.
    pub layer: usize,
    pub group: usize,
    /// Stored byte offset within the group (a multiple of `alignment`).
    pub offset: u64,
    /// Unpadded stored size in bytes (elements x the storage dtype's size).
    pub nbytes: u64,
    /// False for BatchNorm running statistics.
    pub learnable: bool,
}

impl ParamEntry {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64
    }

    /// Byte offset within its group on a device (f32), for a package stored
    /// as `stored` ([`Manifest::param_dtype`]).
    pub fn device_offset(&self, stored: ParamDtype) -> u64 {
        stored.device_bytes(self.offset)
    }

    /// Unpadded size on a device: `4 * numel`.
    pub fn device_nbytes(&self, stored: ParamDtype) -> u64 {
        stored.device_bytes(self.nbytes)
    }
}

/// One group of the packed layout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupEntry {
    pub index: usize,
    /// Byte offset of the group in the whole packed model.
    pub offset: u64,
    /// Padded length (a multiple of `alignment`).
    pub bytes: u64,
    pub first_layer: usize,
    pub last_layer: usize,
    /// `to_hex(checksum(padded group bytes))` (xxh3-64) of the stored bytes.
    pub checksum: String,
}

impl GroupEntry {
    /// Byte offset of the group in the whole model on a device (f32), for a
    /// package stored as `stored` ([`Manifest::param_dtype`]).
    pub fn device_offset(&self, stored: ParamDtype) -> u64 {
        stored.device_bytes(self.offset)
    }

    /// Padded length on a device: the stored group widened element by element.
    pub fn device_bytes(&self, stored: ParamDtype) -> u64 {
        stored.device_bytes(self.bytes)
    }
}

/// Everything about a package except the weights themselves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format_version: u32,
    pub name: String,
    pub family: Family,
    /// The preset the config equals (batch size aside): `full` or `tiny`;
    /// `null` for an imported checkpoint with a config of its own.
    pub scale: Option<Scale>,
    /// Seed the weights were drawn from; `None` for imported checkpoints.
    pub seed: Option<u64>,
    /// Where imported weights came from; absent for generated packages.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<Origin>,
    pub config: ModelConfig,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<OutputSpec>,
    /// How every parameter is stored (weights file, memory servers, host
    /// caches); `F32` when absent (packages written before half precision).
    #[serde(default)]
    pub param_dtype: ParamDtype,
    /// Largest group, in stored bytes.
    pub group_bytes: u64,
    pub alignment: u64,
    pub learnable_param_count: u64,
    /// Sum of the group lengths: the bytes a memory server stores and sends.
    pub stored_bytes: u64,
    pub layers: Vec<Layer>,
    /// In layer order (the packed order).
    pub params: Vec<ParamEntry>,
    pub groups: Vec<GroupEntry>,
}

impl Manifest {
    /// The params of group `g`, in packed order.
    pub fn group_params(&self, g: usize) -> impl Iterator<Item = &ParamEntry> {
        self.params.iter().filter(move |p| p.group == g)
    }

    /// Device bytes per stored byte (2 for half precision, 1 for f32).
    pub fn widen_factor(&self) -> u64 {
        self.param_dtype.widen_factor()
    }

    /// The bytes the whole model takes on a device, every parameter f32:
    /// `stored_bytes` times [`Manifest::widen_factor`].
    pub fn device_bytes(&self) -> u64 {
        self.param_dtype.device_bytes(self.stored_bytes)
    }

    /// Byte offset of param `p` in the whole model on a device.
    pub fn device_param_offset(&self, p: &ParamEntry) -> u64 {
        self.groups[p.group].device_offset(self.param_dtype) + p.device_offset(self.param_dtype)
    }

    /// Checks a request's input shapes against [`Manifest::inputs`] (one
    /// shape per input, each fitting [`TensorSpec::check_shape`]). The error
    /// names the model, the input, what was expected with its variable
    /// dimensions, and what came.
    pub fn check_input_shapes(&self, shapes: &[&[usize]]) -> std::result::Result<(), String> {
        if shapes.len() != self.inputs.len() {
            return Err(format!(
                "model {} takes {} input(s), the request has {}",
                self.name,
                self.inputs.len(),
                shapes.len()
            ));
        }
        for (spec, shape) in self.inputs.iter().zip(shapes) {
            spec.check_shape(shape).map_err(|why| {
                format!(
                    "model {}: input {} is {shape:?}, expected {}: {why}",
                    self.name,
                    spec.name,
                    spec.expected()
                )
            })?;
        }
        Ok(())
    }

    /// The output shapes for a request of input shapes `shapes` (checked
    /// with [`Manifest::check_input_shapes`]), by the shape rules of
    /// [`crate::shape`]: what an executor answers for that request.
    pub fn output_shapes(
        &self,
        shapes: &[&[usize]],
    ) -> std::result::Result<Vec<Vec<usize>>, String> {
        self.check_input_shapes(shapes)?;
        let inputs: Vec<TensorSpec> = self
            .inputs
            .iter()
            .zip(shapes)
            .map(|(spec, shape)| TensorSpec {
                shape: shape.to_vec(),
                ..spec.clone()
            })
            .collect();
        let params: HashMap<&str, &[usize]> = self
            .params
            .iter()
            .map(|p| (p.name.as_str(), p.shape.as_slice()))
            .collect();
        let shapes = shape::infer(&self.layers, &inputs, |n| params.get(n).copied()).map_err(
            |(l, what)| {
                format!(
                    "model {}: layer {l} ({}): {what}",
                    self.name,
                    self.layers.get(l).map_or("?", |l| l.name.as_str())
                )
            },
        )?;
        self.outputs
            .iter()
            .map(|o| {
                shapes.get(o.layer).map(|s| s.dims.clone()).ok_or_else(|| {
                    format!(
                        "model {}: output {} reads missing layer {}",
                        self.name, o.name, o.layer
                    )
                })
            })
            .collect()
    }

    /// Every output's shape as the Open Inference Protocol reports it in
    /// model metadata: `-1` for every dimension that follows a variable
    /// input dimension (found by changing each variable input dimension in
    /// turn and seeing which output dimensions move), the size otherwise.
    pub fn output_protocol_shapes(&self) -> Vec<Vec<i64>> {
        let default: Vec<&[usize]> = self.inputs.iter().map(|i| i.shape.as_slice()).collect();
        let base: Vec<Vec<usize>> = match self.output_shapes(&default) {
            Ok(s) => s,
            // An opened package infers at its default shape; a manifest
            // that does not reports its declared shapes.
            Err(_) => self.outputs.iter().map(|o| o.shape.clone()).collect(),
        };
        let mut out: Vec<Vec<i64>> = base
            .iter()
            .map(|s| s.iter().map(|&n| n as i64).collect())
            .collect();
        for (i, spec) in self.inputs.iter().enumerate() {
            for v in &spec.variable {
                let n = spec.shape[v.dim];
                // Another size inside the bound: one more, or one less at the bound.
                let other = if v.max.is_some_and(|m| n >= m) {
                    n - 1
                } else {
                    n + 1
                };
                if other == 0 {
                    continue;
                }
                let mut moved: Vec<Vec<usize>> =
                    self.inputs.iter().map(|i| i.shape.clone()).collect();
                moved[i][v.dim] = other;
                let moved: Vec<&[usize]> = moved.iter().map(Vec::as_slice).collect();
                let Ok(shapes) = self.output_shapes(&moved) else {
                    continue;
                };
                for ((o, b), m) in out.iter_mut().zip(&base).zip(&shapes) {
                    for (d, (x, y)) in b.iter().zip(m).enumerate() {
                        if x != y {
                            o[d] = -1;
                        }
                    }
                }
            }
        }
        out
    }
}

/// The checkpoint an imported package was made from (`distmind model import`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Origin {
    /// The checkpoint's file name as given to the importer.
    pub checkpoint: String,
    /// The checkpoint's parameter dtypes (safetensors spelling: `F32`, `F16`, `BF16`).
    pub checkpoint_dtypes: Vec<String>,
    /// Parameters are stored as f32 although the checkpoint held half
    /// precision: widened exactly at import (`--widen`, or a checkpoint
    /// mixing dtypes).
    pub converted_to_f32: bool,
    /// The key prefix stripped from every name (`bert.`, `module.`, ...), if any.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub stripped_prefix: String,
    /// Checkpoint tensors not used by inference and left out (BatchNorm
    /// `num_batches_tracked`, Inception's `AuxLogits.*`, attention mask
    /// buffers, task heads with `--ignore-extra`).
    pub dropped: Vec<String>,
    /// Where the hyper-parameters came from (`config.json`, the tensor shapes).
    pub config_source: String,
}

/// What names a package being written.
#[derive(Debug, Clone)]
pub struct PackageSpec {
    pub name: String,
    pub config: ModelConfig,
    pub scale: Option<Scale>,
    pub seed: Option<u64>,
    pub origin: Option<Origin>,
    pub group_bytes: u64,
    /// How the parameters are stored; the bytes given to [`write_package`]
    /// are in this dtype.
    pub dtype: ParamDtype,
}

/// Borrowed stored bytes as a safetensors view.
struct StoredView<'a> {
    dtype: ParamDtype,
    shape: &'a [usize],
    data: &'a [u8],
}

impl safetensors::View for StoredView<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        match self.dtype {
            ParamDtype::F32 => safetensors::Dtype::F32,
            ParamDtype::F16 => safetensors::Dtype::F16,
            ParamDtype::BF16 => safetensors::Dtype::BF16,
        }
    }
    fn shape(&self) -> &[usize] {
        self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn layout_of(
    layers: &[Layer],
    names: &HashMap<&str, (usize, u64)>,
    group_bytes: u64,
) -> Result<Layout, String> {
    layout::plan(
        layers,
        names.len(),
        |n| names.get(n).copied(),
        group_bytes,
        PARAM_ALIGN_BYTES,
    )
}

/// Writes `dir/<name>/` from an architecture's params and their bytes
/// (`data[i]`: the little-endian values of `arch.params[i]` in `spec.dtype`).
/// Returns the manifest.
pub fn write_package(
    out_dir: &Path,
    spec: &PackageSpec,
    arch: &Architecture,
    data: &[Vec<u8>],
) -> Result<Manifest> {
    if spec.group_bytes == 0 {
        return Err(ModelError::InvalidOption(
            "group_bytes must be at least 1".into(),
        ));
    }
    assert_eq!(arch.params.len(), data.len(), "one byte buffer per param");
    let dir = out_dir.join(&spec.name);
    std::fs::create_dir_all(&dir)
        .map_err(ModelError::io(&dir, "cannot create package directory"))?;
    let mut names = HashMap::new();
    for (i, (p, d)) in arch.params.iter().zip(data).enumerate() {
        let nbytes = p.numel() as u64 * spec.dtype.size_bytes();
        assert_eq!(
            d.len() as u64,
            nbytes,
            "param {} has {} bytes, expected {nbytes}",
            p.name,
            d.len()
        );
        if names.insert(p.name.as_str(), (i, nbytes)).is_some() {
            panic!("architecture declares param {} twice", p.name);
        }
    }
    let mut layout =
        layout_of(&arch.layers, &names, spec.group_bytes).map_err(|what| ModelError::Graph {
            model: spec.name.clone(),
            layer: 0,
            name: String::new(),
            what,
        })?;
    // Checksums of the padded groups, streamed in layer order.
    let zeros = vec![0u8; PARAM_ALIGN_BYTES as usize];
    let mut sums: Vec<Checksummer> = vec![Checksummer::new(); layout.groups.len()];
    let mut order: Vec<usize> = (0..arch.params.len()).collect();
    order.sort_by_key(|&i| (layout.placements[i].group, layout.placements[i].offset));
    for &i in &order {
        let d = &data[i];
        let g = layout.placements[i].group;
        sums[g].update(d);
        let pad = align_up(d.len() as u64, PARAM_ALIGN_BYTES) as usize - d.len();
        sums[g].update(&zeros[..pad]);
    }
    let views = arch.params.iter().zip(data).map(|(p, d)| {
        (
            p.name.clone(),
            StoredView {
                dtype: spec.dtype,
                shape: &p.shape,
                data: d,
            },
        )
    });
    let weights = dir.join(WEIGHTS_FILE);
    safetensors::serialize_to_file(views, None, &weights).map_err(|e| ModelError::BadWeights {
        path: weights.clone(),
        what: format!("cannot write: {e}"),
    })?;
    let mut layers = arch.layers.clone();
    for (l, g) in layers.iter_mut().zip(&layout.layer_groups) {
        l.group = *g;
    }
    let owner: HashMap<&str, usize> = arch
        .layers
        .iter()
        .flat_map(|l| l.params.iter().map(move |p| (p.as_str(), l.id)))
        .collect();
    let params = order
        .iter()
        .map(|&i| {
            let p = &arch.params[i];
            let pl = layout.placements[i];
            ParamEntry {
                name: p.name.clone(),
                shape: p.shape.clone(),
                dtype: Dtype::F32,
                layer: owner[p.name.as_str()],
                group: pl.group,
                offset: pl.offset,
                nbytes: data[i].len() as u64,
                learnable: p.learnable,
            }
        })
        .collect::<Vec<_>>();
    let manifest = Manifest {
        format_version: FORMAT_VERSION,
        name: spec.name.clone(),
        family: spec.config.family(),
        scale: spec.scale,
        seed: spec.seed,
        origin: spec.origin.clone(),
        config: spec.config.clone(),
        inputs: arch.inputs.clone(),
        outputs: arch.outputs.clone(),
        param_dtype: spec.dtype,
        group_bytes: spec.group_bytes,
        alignment: PARAM_ALIGN_BYTES,
        learnable_param_count: arch.learnable_param_count(),
        stored_bytes: layout.stored_bytes(),
        layers,
        params,
        groups: std::mem::take(&mut layout.groups)
            .into_iter()
            .zip(&sums)
            .enumerate()
            .map(|(index, (g, s))| GroupEntry {
                index,
                offset: g.offset,
                bytes: g.bytes,
                first_layer: g.first_layer,
                last_layer: g.last_layer,
                checksum: to_hex(s.finish()),
            })
            .collect(),
    };
    let path = dir.join(MANIFEST_FILE);
    let file = File::create(&path).map_err(ModelError::io(&path, "cannot create manifest"))?;
    let mut w = BufWriter::new(file);
    serde_json::to_writer_pretty(&mut w, &manifest).map_err(|source| {
        ModelError::ManifestParse {
            path: path.clone(),
            source,
        }
    })?;
    w.write_all(b"\n")
        .and_then(|_| w.flush())
        .map_err(ModelError::io(&path, "cannot write manifest"))?;
    Ok(manifest)
}

/// An opened, validated package.
#[derive(Debug)]
pub struct Package {
    pub dir: PathBuf,
    pub manifest: Manifest,
    weights_path: PathBuf,
    weights: File,
    /// Per manifest param: absolute byte offset of its data in the weights file.
    file_offsets: Vec<u64>,
    /// Per group: range of manifest params it holds.
    group_ranges: Vec<std::ops::Range<usize>>,
}

/// One tensor of a safetensors header.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct SafetensorsEntry {
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Byte range relative to the start of the data section.
    pub data_offsets: [u64; 2],
}

/// A safetensors file's header, read with a bounded length.
#[derive(Debug)]
pub(crate) struct SafetensorsHeader {
    pub file: File,
    pub file_len: u64,
    /// Absolute offset of the data section (8 + header length).
    pub data_start: u64,
    /// Every tensor (the `__metadata__` entry left out).
    pub tensors: HashMap<String, SafetensorsEntry>,
}

/// Opens `path` and parses its safetensors header. Errors name the file.
pub(crate) fn read_safetensors_header(path: &Path) -> Result<SafetensorsHeader> {
    let bad = |what: String| ModelError::BadWeights {
        path: path.to_path_buf(),
        what,
    };
    let mut file = File::open(path).map_err(ModelError::io(path, "cannot open"))?;
    let file_len = file
        .metadata()
        .map_err(ModelError::io(path, "cannot stat"))?
        .len();
    let mut n = [0u8; 8];
    file.read_exact(&mut n)
        .map_err(|_| bad("shorter than a safetensors header".into()))?;
    let n = u64::from_le_bytes(n);
    if n > SAFETENSORS_HEADER_BYTES_MAX || 8 + n > file_len {
        return Err(bad(format!(
            "header length {n} does not fit a {file_len}-byte file (not a safetensors file?)"
        )));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header)
        .map_err(ModelError::io(path, "cannot read header"))?;
    let mut entries: HashMap<String, serde_json::Value> = serde_json::from_slice(&header)
        .map_err(|e| bad(format!("header is not valid JSON: {e}")))?;
    entries.remove("__metadata__");
    let mut tensors = HashMap::with_capacity(entries.len());
    for (name, v) in entries {
        let e: SafetensorsEntry = serde_json::from_value(v)
            .map_err(|err| bad(format!("tensor {name}: bad header entry: {err}")))?;
        tensors.insert(name, e);
    }
    Ok(SafetensorsHeader {
        file,
        file_len,
        data_start: 8 + n,
        tensors,
    })
}

impl Package {
    /// Opens `dir` (holding `manifest.json` and `weights.safetensors`) and
    /// checks that the manifest, the graph, the layout and the weights file
    /// agree. Group checksums are checked by [`Package::verify`].
    pub fn open(dir: impl AsRef<Path>) -> Result<Package> {
        let dir = dir.as_ref().to_path_buf();
        let mpath = dir.join(MANIFEST_FILE);
        let text = std::fs::read(&mpath).map_err(ModelError::io(&mpath, "cannot read manifest"))?;
        let manifest: Manifest =
            serde_json::from_slice(&text).map_err(|source| ModelError::ManifestParse {
                path: mpath.clone(),
                source,
            })?;
        let bad = |what: String| ModelError::BadManifest {
            path: mpath.clone(),
            what,
        };
        let group_ranges = check_manifest(&manifest).map_err(bad)?;
        let weights_path = dir.join(WEIGHTS_FILE);
        let (weights, file_offsets) = check_weights(&weights_path, &manifest)?;
        Ok(Package {
            dir,
            manifest,
            weights_path,
            weights,
            file_offsets,
            group_ranges,
        })
    }

    pub fn group_count(&self) -> usize {
        self.manifest.groups.len()
    }

    /// The packed, zero-padded bytes of group `g`.
    pub fn group_bytes(&self, g: usize) -> Result<Vec<u8>> {
        let entry = self.manifest.groups.get(g).ok_or(ModelError::NoSuchGroup {
            group: g,
            groups: self.manifest.groups.len(),
        })?;
        let mut buf = vec![0u8; entry.bytes as usize];
        for i in self.group_ranges[g].clone() {
            let p = &self.manifest.params[i];
            let dst = &mut buf[p.offset as usize..(p.offset + p.nbytes) as usize];
            self.weights
                .read_exact_at(dst, self.file_offsets[i])
                .map_err(ModelError::io(
                    &self.weights_path,
                    "cannot read parameter bytes",
                ))?;
        }
        Ok(buf)
    }

    /// All groups, packed.
    pub fn packed(&self) -> Result<Vec<Vec<u8>>> {
        (0..self.group_count())
            .map(|g| self.group_bytes(g))
            .collect()
    }

    /// The stored bytes of one param, by name: little-endian values of
    /// [`Manifest::param_dtype`].
    pub fn param_bytes(&self, name: &str) -> Result<Vec<u8>> {
        let i = self
            .manifest
            .params
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| ModelError::BadManifest {
                path: self.dir.join(MANIFEST_FILE),
                what: format!("no param named {name}"),
            })?;
        let mut buf = vec![0u8; self.manifest.params[i].nbytes as usize];
        self.weights
            .read_exact_at(&mut buf, self.file_offsets[i])
            .map_err(ModelError::io(
                &self.weights_path,
                "cannot read parameter bytes",
            ))?;
        Ok(buf)
    }

    /// One param's values, widened to f32 (exactly).
    pub fn param_f32(&self, name: &str) -> Result<Vec<f32>> {
        let bytes = self.param_bytes(name)?;
        Ok(crate::dtype::widen_to_vec(
            self.manifest.param_dtype,
            &bytes,
        ))
    }

    /// Recomputes every group's checksum and compares it with the manifest.
    pub fn verify(&self) -> Result<()> {
        for (g, entry) in self.manifest.groups.iter().enumerate() {
            let actual = to_hex(checksum(&self.group_bytes(g)?));
            if actual != entry.checksum {
                return Err(ModelError::Checksum {
                    path: self.weights_path.clone(),
                    group: g,
                    expected: entry.checksum.clone(),
                    actual,
                });
            }
        }
        Ok(())
    }
}

/// Checks the manifest against itself: graph shapes, params used once, the
/// recorded layout equal to the recomputed one. Returns each group's param range.
fn check_manifest(m: &Manifest) -> Result<Vec<std::ops::Range<usize>>, String> {
    if m.format_version != FORMAT_VERSION {
        return Err(format!(
            "format_version {} (this build reads {FORMAT_VERSION})",
            m.format_version
        ));
    }
    if m.alignment != PARAM_ALIGN_BYTES {
        return Err(format!(
            "alignment {} (expected {PARAM_ALIGN_BYTES})",
            m.alignment
        ));
    }
    if m.group_bytes == 0 {
        return Err("group_bytes is 0".into());
    }
    if m.config.family() != m.family {
        return Err(format!(
            "family {} but config of {}",
            m.family,
            m.config.family()
        ));
    }
    let mut names: HashMap<&str, (usize, u64)> = HashMap::new();
    for (i, p) in m.params.iter().enumerate() {
        if p.dtype != Dtype::F32 {
            return Err(format!(
                "param {} has dtype {:?}, expected F32 (the storage dtype is param_dtype)",
                p.name, p.dtype
            ));
        }
        let want = p.numel() * m.param_dtype.size_bytes();
        if p.nbytes != want {
            return Err(format!(
                "param {} has nbytes {} but shape {:?} stored as {} needs {want}",
                p.name,
                p.nbytes,
                p.shape,
                m.param_dtype.safetensors_name()
            ));
        }
        if names.insert(&p.name, (i, p.nbytes)).is_some() {
            return Err(format!("param {} listed twice", p.name));
        }
    }
    for spec in &m.inputs {
        spec.validate()?;
    }
    let shapes = shape::infer(&m.layers, &m.inputs, |n| {
        names.get(n).map(|&(i, _)| m.params[i].shape.as_slice())
    })
    .map_err(|(l, what)| format!("layer {l} ({}): {what}", m.layers[l].name))?;
    // Every bounded variable dimension at its bound must fit the graph too
    // (a sequence bound no larger than the position table), so a request
    // the input check accepts never fails in a layer.
    if m.inputs
        .iter()
        .any(|i| i.variable.iter().any(|v| v.max.is_some()))
    {
        let at_max: Vec<TensorSpec> = m
            .inputs
            .iter()
            .map(|spec| {
                let mut shape = spec.shape.clone();
                for v in &spec.variable {
                    if let Some(max) = v.max {
                        shape[v.dim] = max;
                    }
                }
                TensorSpec {
                    shape,
                    ..spec.clone()
                }
            })
            .collect();
        shape::infer(&m.layers, &at_max, |n| {
            names.get(n).map(|&(i, _)| m.params[i].shape.as_slice())
        })
        .map_err(|(l, what)| {
            format!(
                "layer {l} ({}) at the inputs' largest shapes: {what}",
                m.layers[l].name
            )
        })?;
    }
    for o in &m.outputs {
        let s = shapes
            .get(o.layer)
            .ok_or_else(|| format!("output {} reads missing layer {}", o.name, o.layer))?;
        if s.dims != o.shape || s.dtype != o.dtype {
            return Err(format!(
                "output {} declared {:?} but layer {} gives {:?}",
                o.name, o.shape, o.layer, s.dims
            ));
        }
    }
    let layout = layout_of(&m.layers, &names, m.group_bytes)?;
    for (l, g) in m.layers.iter().zip(&layout.layer_groups) {
        if l.group != *g {
            return Err(format!(
                "layer {} ({}) in group {:?}, layout gives {:?}",
                l.id, l.name, l.group, g
            ));
        }
    }
    for (i, (p, pl)) in m.params.iter().zip(&layout.placements).enumerate() {
        if (p.group, p.offset) != (pl.group, pl.offset) {
            return Err(format!(
                "param {} at group {} offset {}, layout gives group {} offset {}",
                p.name, p.group, p.offset, pl.group, pl.offset
            ));
        }
        if i > 0 && (m.params[i - 1].group, m.params[i - 1].offset) > (p.group, p.offset) {
            return Err(format!("param {} is out of layer order", p.name));
        }
        if !m.layers[p.layer].params.contains(&p.name) {
            return Err(format!(
                "param {} names layer {} which does not use it",
                p.name, p.layer
            ));
        }
    }
    if m.groups.len() != layout.groups.len() {
        return Err(format!(
            "{} groups, layout gives {}",
            m.groups.len(),
            layout.groups.len()
        ));
    }
    for (i, (g, plan)) in m.groups.iter().zip(&layout.groups).enumerate() {
        let recorded = (g.index, g.offset, g.bytes, g.first_layer, g.last_layer);
        let want = (
            i,
            plan.offset,
            plan.bytes,
            plan.first_layer,
            plan.last_layer,
        );
        if recorded != want {
            return Err(format!(
                "group {i} is (index, offset, bytes, first_layer, last_layer) = {recorded:?}, layout gives {want:?}"
            ));
        }
        if distmind_common::checksum::from_hex(&g.checksum).is_none() {
            return Err(format!(
                "group {i} checksum {:?} is not 16 hex digits",
                g.checksum
            ));
        }
    }
    if m.stored_bytes != layout.stored_bytes() {
        return Err(format!(
            "stored_bytes {} but groups sum to {}",
            m.stored_bytes,
            layout.stored_bytes()
        ));
    }
    let learnable: u64 = m
        .params
        .iter()
        .filter(|p| p.learnable)
        .map(ParamEntry::numel)
        .sum();
    if m.learnable_param_count != learnable {
        return Err(format!(
            "learnable_param_count {} but params give {learnable}",
            m.learnable_param_count
        ));
    }
    let mut ranges = vec![0..0; m.groups.len()];
    for (i, p) in m.params.iter().enumerate() {
        let r = &mut ranges[p.group];
        if r.start == r.end {
            *r = i..i + 1;
        } else {
            r.end = i + 1;
        }
    }
    Ok(ranges)
}

/// Reads the safetensors header and checks every param against it.
/// Returns the open file and each param's absolute data offset.
fn check_weights(path: &Path, m: &Manifest) -> Result<(File, Vec<u64>)> {
    let bad = |what: String| ModelError::BadWeights {
        path: path.to_path_buf(),
        what,
    };
    let SafetensorsHeader {
        file,
        file_len,
        data_start,
        mut tensors,
    } = read_safetensors_header(path)?;
    let mut data_end = 0u64;
    let mut offsets = Vec::with_capacity(m.params.len());
    for p in &m.params {
        let e = tensors
            .remove(&p.name)
            .ok_or_else(|| bad(format!("tensor {} is missing", p.name)))?;
        let want = m.param_dtype.safetensors_name();
        if e.dtype != want || e.shape != p.shape {
            return Err(bad(format!(
                "tensor {} is {} {:?}, expected {want} {:?} (the manifest's param_dtype)",
                p.name, e.dtype, e.shape, p.shape
            )));
        }
        let [s, t] = e.data_offsets;
        if t < s || t - s != p.nbytes {
            return Err(bad(format!(
                "tensor {} spans {s}..{t}, expected {} bytes",
                p.name, p.nbytes
            )));
        }
        data_end = data_end.max(t);
        offsets.push(data_start + s);
    }
    if let Some(extra) = tensors.keys().next() {
        return Err(bad(format!("tensor {extra} is not in the manifest")));
    }
    if data_start + data_end != file_len {
        return Err(bad(format!(
            "file is {file_len} bytes, header says {} (truncated or trailing bytes)",
            data_start + data_end
        )));
    }
    Ok((file, offsets))
}
