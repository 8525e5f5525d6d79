//! `distmind plot`: PNG figures from the experiment CSVs, drawn in Rust with
//! [plotters](https://docs.rs/plotters) (bitmap backend, fonts through
//! `ab_glyph`: no fontconfig or freetype).
//!
//! The artifact-evaluation scripts (`ae/<test>/run.sh`) append rows to
//! `results/*.csv` and then call `distmind plot bars|lines ...`:
//!
//! - [`PlotCommand::Bars`]: a grouped bar chart. `--x` names the category
//!   column (categories in order of first appearance), `--series` one bar per
//!   distinct value inside each category (with a legend), `--y` the bar
//!   height. Optional whiskers (`--whisker-low`/`--whisker-high`, e.g.
//!   p50..p99) and a `--reference` series drawn as dashed "bound" lines
//!   instead of bars (e.g. the local-GPU baseline). Several rows for one
//!   (x, series) pair are averaged, with a warning on stderr.
//! - [`PlotCommand::Lines`]: numeric `--x`; several `--y` columns, or one
//!   `--y` split by `--series`, become lines with marked points; `--stacked`
//!   draws stacked areas instead (utilisation over time).
//!
//! # The CSV contract
//!
//! A header row, then comma-separated records (double-quoted fields are
//! accepted; see [`table`]). Besides the plotted columns every results CSV
//! must have an `executor` column (`sim`, `cpu` or `cuda`) and a `profile`
//! column (the GPU profile a simulated executor's timings come from). Rows
//! are first narrowed by `--filter COL=VALUE` (every filter must match
//! exactly).
//!
//! # The caption rule
//!
//! Every figure carries a caption under the plot area saying which executor
//! produced the numbers, built from the plotted rows ([`executor_caption`]):
//! `sim` rows give "GPU time simulated from `<profiles>`", `cpu` rows
//! "executor: cpu (real model math on this CPU)", `cuda` rows
//! "executor: cuda (measured on a GPU)"; a figure mixing executors lists
//! each, joined by "; ". `--caption TEXT` is appended after " | ".
//!
//! # Fonts
//!
//! The TrueType font is read at run time: `$DISTMIND_FONT` if set, else the
//! first of [`DEFAULT_FONTS`] that exists (`apt-get install
//! fonts-dejavu-core` provides the first).

use std::ffi::OsString;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{anyhow, bail, Context, Result};
use plotters::coord::ranged1d::{KeyPointHint, NoDefaultFormatting, Ranged, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;

mod bars;
mod lines;
pub mod table;

pub use table::{Filter, Table};

/// `distmind plot ...`
#[derive(clap::Subcommand, Debug, Clone)]
pub enum PlotCommand {
    /// Grouped bar chart: categories on x, one bar per series value.
    Bars(BarsArgs),
    /// Lines (or stacked areas) over a numeric x column.
    Lines(LinesArgs),
}

/// Arguments every figure takes.
#[derive(clap::Args, Debug, Clone)]
pub struct CommonArgs {
    /// Experiment CSV: header row, comma separated, with `executor` and
    /// `profile` columns.
    #[arg(long, value_name = "FILE")]
    pub csv: PathBuf,
    /// The PNG to write (parent directories are created).
    #[arg(long, value_name = "FILE.png")]
    pub out: PathBuf,
    /// Title above the plot.
    #[arg(long)]
    pub title: Option<String>,
    /// X axis label (default: the x column's name).
    #[arg(long)]
    pub x_label: Option<String>,
    /// Y axis label, with units, e.g. "mean latency (ms)" (default: the y
    /// column's name).
    #[arg(long)]
    pub y_label: Option<String>,
    /// Keep only rows whose COL is exactly VALUE (repeatable; all must match).
    #[arg(long = "filter", value_name = "COL=VALUE")]
    pub filters: Vec<Filter>,
    /// Extra text appended to the executor caption line.
    #[arg(long)]
    pub caption: Option<String>,
    /// Image width in pixels.
    #[arg(long, default_value_t = 1000)]
    pub width: u32,
    /// Image height in pixels.
    #[arg(long, default_value_t = 600)]
    pub height: u32,
    /// Logarithmic y axis (every plotted value must be > 0).
    #[arg(long)]
    pub log_y: bool,
}

/// `distmind plot bars`
#[derive(clap::Args, Debug, Clone)]
pub struct BarsArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Category column (x axis), categories in order of first appearance.
    #[arg(long, value_name = "COL")]
    pub x: String,
    /// Series column: one bar per distinct value in each category (default:
    /// a single series named after --y).
    #[arg(long, value_name = "COL")]
    pub series: Option<String>,
    /// Fix the order of the series and plot only these (comma separated).
    #[arg(long, value_name = "A,B,C", value_delimiter = ',', requires = "series")]
    pub series_order: Option<Vec<String>>,
    /// Numeric column: bar height.
    #[arg(long, value_name = "COL")]
    pub y: String,
    /// Numeric column: lower end of a whisker on each bar (e.g. p50).
    #[arg(long, value_name = "COL", requires = "whisker_high")]
    pub whisker_low: Option<String>,
    /// Numeric column: upper end of a whisker on each bar (e.g. p99).
    #[arg(long, value_name = "COL", requires = "whisker_low")]
    pub whisker_high: Option<String>,
    /// A value of the series column drawn as a dashed "`<value>` (bound)" line
    /// per category (or one line across the chart) instead of bars.
    #[arg(long, value_name = "SERIES_VALUE", requires = "series")]
    pub reference: Option<String>,
}

/// `distmind plot lines`
#[derive(clap::Args, Debug, Clone)]
pub struct LinesArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Numeric x column.
    #[arg(long, value_name = "COL")]
    pub x: String,
    /// Numeric y column (repeatable: each column becomes a series).
    #[arg(long, value_name = "COL", required = true)]
    pub y: Vec<String>,
    /// One line per distinct value of this column (with a single --y).
    #[arg(long, value_name = "COL")]
    pub series: Option<String>,
    /// Stacked areas in series order (the top edge is the sum).
    #[arg(long)]
    pub stacked: bool,
}

/// Run a `distmind plot` subcommand: read the CSV, draw, write the PNG.
pub fn run(cmd: &PlotCommand) -> Result<()> {
    match cmd {
        PlotCommand::Bars(a) => {
            check_output(&a.common)?;
            let fig = bars::prepare(a)?;
            warn(&fig.warnings);
            render(&a.common, |root| bars::draw(root, &fig))
        }
        PlotCommand::Lines(a) => {
            check_output(&a.common)?;
            let fig = lines::prepare(a)?;
            warn(&fig.warnings);
            render(&a.common, |root| lines::draw(root, &fig))
        }
    }
}

fn warn(warnings: &[String]) {
    for w in warnings {
        eprintln!("warning: {w}");
    }
}

fn check_output(c: &CommonArgs) -> Result<()> {
    let png = c
        .out
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("png"));
    if !png {
        bail!("--out {}: the file name must end in .png", c.out.display());
    }
    if !(200..=10_000).contains(&c.width) || !(150..=10_000).contains(&c.height) {
        bail!(
            "--width {} --height {}: expected 200..=10000 x 150..=10000 pixels",
            c.width,
            c.height
        );
    }
    Ok(())
}

/// Draw with `f` onto a bitmap of the requested size and write it as PNG.
fn render(
    c: &CommonArgs,
    f: impl FnOnce(&DrawingArea<BitMapBackend<'_>, Shift>) -> Result<()>,
) -> Result<()> {
    ensure_font()?;
    if let Some(dir) = c.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let root = BitMapBackend::new(&c.out, (c.width, c.height)).into_drawing_area();
    f(&root)?;
    root.present()
        .map_err(|e| anyhow!("writing {}: {e}", c.out.display()))?;
    println!("wrote {}", c.out.display());
    Ok(())
}

// ---------------------------------------------------------------- fonts --

/// Fonts tried, in order, when `$DISTMIND_FONT` is not set.
pub const DEFAULT_FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

/// Find and read the font: `env` (the value of `$DISTMIND_FONT`) if set,
/// else the first existing of `defaults`.
fn find_font(env: Option<OsString>, defaults: &[&str]) -> Result<(PathBuf, Vec<u8>)> {
    if let Some(p) = env.filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        let bytes = std::fs::read(&p).with_context(|| {
            format!("reading the font named by DISTMIND_FONT ({})", p.display())
        })?;
        return Ok((p, bytes));
    }
    for p in defaults {
        let p = Path::new(p);
        if p.is_file() {
            let bytes =
                std::fs::read(p).with_context(|| format!("reading font {}", p.display()))?;
            return Ok((p.to_path_buf(), bytes));
        }
    }
    bail!(
        "distmind plot needs a TrueType font and found none; tried {}. \
         Install one with `apt-get install fonts-dejavu-core`, or set \
         DISTMIND_FONT=/path/to/font.ttf",
        defaults.join(", ")
    )
}

/// Load the font once per process and register it as "sans-serif" with
/// plotters. Every later call returns the first call's outcome.
pub fn ensure_font() -> Result<()> {
    static FONT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let (path, bytes) = find_font(std::env::var_os("DISTMIND_FONT"), DEFAULT_FONTS)
            .map_err(|e| format!("{e:#}"))?;
        // plotters keeps the font for the life of the process: leak it once.
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).map_err(|_| {
            format!(
                "{} is not a TrueType/OpenType font plotters can read (set DISTMIND_FONT to one)",
                path.display()
            )
        })
    })
    .clone()
    .map_err(|e| anyhow!(e))
}

// -------------------------------------------------------------- caption --

/// The caption line for the rows of `table` (which must be the plotted
/// rows): which executor produced them, then " | " and `extra` if given.
pub fn executor_caption(table: &Table, extra: Option<&str>) -> Result<String> {
    let need = |name: &str| {
        table.col(name).map_err(|_| {
            anyhow!(
                "{} has no {name:?} column: every results CSV must record the executor \
                 (sim, cpu or cuda) and the GPU profile, so that the figure can say what \
                 produced it (columns: {})",
                table.path.display(),
                table.header.join(", ")
            )
        })
    };
    let ec = need("executor")?;
    let pc = need("profile")?;
    if let Some(r) = table.rows.iter().find(|r| r.fields[ec].is_empty()) {
        bail!(
            "{}:{}: the executor field is empty",
            table.path.display(),
            r.line
        );
    }
    let executors = table.distinct(ec);
    let parts: Vec<String> = executors
        .iter()
        .map(|e| match e.as_str() {
            "sim" => {
                let profiles = table::distinct(
                    table
                        .rows
                        .iter()
                        .filter(|r| r.fields[ec] == "sim" && !r.fields[pc].is_empty())
                        .map(|r| r.fields[pc].as_str()),
                );
                if profiles.is_empty() {
                    "GPU time simulated (profile not recorded)".to_string()
                } else {
                    format!("GPU time simulated from {}", profiles.join(", "))
                }
            }
            "cpu" => "executor: cpu (real model math on this CPU)".to_string(),
            "cuda" => "executor: cuda (measured on a GPU)".to_string(),
            other => format!("executor: {other}"),
        })
        .collect();
    let mut caption = parts.join("; ");
    if let Some(extra) = extra.filter(|x| !x.trim().is_empty()) {
        caption.push_str(" | ");
        caption.push_str(extra);
    }
    Ok(caption)
}

// ------------------------------------------------------ shared drawing --

/// Texts around the plot, shared by both figure kinds.
#[derive(Debug, Clone)]
pub(crate) struct Labels {
    pub title: Option<String>,
    pub x_label: String,
    pub y_label: String,
    pub caption: String,
}

pub(crate) const FONT: &str = "sans-serif";

/// Distinguishable colours (matplotlib's tab10).
pub(crate) const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

pub(crate) fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// A plotters drawing error as an anyhow error.
pub(crate) fn draw_err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing the figure failed: {e:?}")
}

/// Fill the background, draw the caption (word-wrapped) along the bottom
/// and return the area left for the chart.
pub(crate) fn frame<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    caption: &str,
) -> Result<DrawingArea<DB, Shift>> {
    ensure_font()?;
    root.fill(&WHITE).map_err(draw_err)?;
    let (w, h) = root.dim_in_pixel();
    let style = TextStyle::from((FONT, 13).into_font()).color(&RGBColor(60, 60, 60));
    let max_w = w.saturating_sub(24).max(50);
    let mut lines: Vec<String> = Vec::new();
    for word in caption.split(' ') {
        let candidate = match lines.last() {
            Some(l) => format!("{l} {word}"),
            None => word.to_string(),
        };
        let fits = root
            .estimate_text_size(&candidate, &style)
            .map(|(cw, _)| cw <= max_w)
            .unwrap_or(true);
        match lines.last_mut() {
            Some(l) if fits => *l = candidate,
            None => lines.push(candidate),
            Some(_) => lines.push(word.to_string()),
        }
    }
    let line_h = 17u32;
    let cap_h = (line_h * lines.len() as u32 + 10).min(h / 3);
    let (upper, lower) = root.split_vertically(h - cap_h);
    for (i, l) in lines.iter().enumerate() {
        lower
            .draw_text(l, &style, (12, 2 + (i as u32 * line_h) as i32))
            .map_err(draw_err)?;
    }
    Ok(upper)
}

/// Number formatting for ticks and bar labels: short, no float noise.
pub(crate) fn fmt_num(v: f64) -> String {
    fn trim(s: String) -> String {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    }
    if v == 0.0 {
        return "0".to_string();
    }
    let a = v.abs();
    if !(1e-3..1e6).contains(&a) {
        let s = format!("{v:.2e}");
        let (m, e) = s.split_once('e').unwrap_or((&s, "0"));
        return format!("{}e{e}", trim(m.to_string()));
    }
    let decimals = if a >= 100.0 {
        1
    } else if a >= 1.0 {
        2
    } else {
        4
    };
    trim(format!("{v:.decimals$}"))
}

/// The y axis: linear or logarithmic behind one type, so one drawing
/// routine serves both.
pub(crate) enum YAxis {
    Linear(RangedCoordf64),
    Log(LogCoord<f64>),
}

impl YAxis {
    /// Linear: from 0 (or below the smallest negative value) to max*1.15.
    /// Log: from the decade below the smallest value to max*1.15; every
    /// value must be > 0 (checked by the caller with row context).
    pub fn fit(values: &[f64], log: bool) -> YAxis {
        let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        if log {
            let min = if min.is_finite() && min > 0.0 {
                min
            } else {
                1.0
            };
            // The decade below the smallest value (one more if it is a
            // decade itself, so that its bar shows).
            let lo = 10f64.powf(min.log10().ceil() - 1.0);
            // 15% headroom, measured in decades.
            let hi = if max.is_finite() && max > lo {
                10f64.powf(max.log10() + 0.15 * (max / lo).log10())
            } else {
                lo * 10.0
            };
            YAxis::Log((lo..hi).log_scale().into())
        } else {
            let lo = if min.is_finite() && min < 0.0 {
                min * 1.15
            } else {
                0.0
            };
            let hi = if max.is_finite() && max > 0.0 {
                max * 1.15
            } else {
                0.0
            };
            let hi = if hi > lo { hi } else { lo + 1.0 };
            YAxis::Linear((lo..hi).into())
        }
    }

    /// Where bars start: 0 on a linear axis, the bottom of a log one.
    pub fn baseline(&self) -> f64 {
        match self {
            YAxis::Linear(_) => 0.0,
            YAxis::Log(l) => l.range().start,
        }
    }
}

impl Ranged for YAxis {
    type FormatOption = NoDefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        match self {
            YAxis::Linear(r) => r.map(value, limit),
            YAxis::Log(r) => r.map(value, limit),
        }
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        match self {
            YAxis::Linear(r) => r.key_points(hint),
            YAxis::Log(r) => log_key_points(r.range(), hint),
        }
    }

    fn range(&self) -> Range<f64> {
        match self {
            YAxis::Linear(r) => r.range(),
            YAxis::Log(r) => r.range(),
        }
    }
}

/// Ticks on a log axis: every decade, with 2 and 5 too when the axis spans
/// two and a half decades or less; light lines at 2..9 times each decade.
fn log_key_points<Hint: KeyPointHint>(range: Range<f64>, hint: Hint) -> Vec<f64> {
    let (lo, hi) = (range.start, range.end);
    let e0 = (lo.log10() - 1e-9).floor() as i32;
    let e1 = (hi.log10() + 1e-9).floor() as i32;
    let bold = !hint.weight().allow_light_points();
    let mults: &[f64] = if !bold {
        &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    } else if (hi / lo).log10() <= 2.5 {
        &[1.0, 2.0, 5.0]
    } else {
        &[1.0]
    };
    let inside = |v: f64| v >= lo * (1.0 - 1e-9) && v <= hi * (1.0 + 1e-9);
    let mut out: Vec<f64> = (e0..=e1)
        .flat_map(|e| mults.iter().map(move |m| m * 10f64.powi(e)))
        .filter(|v| inside(*v))
        .collect();
    if out.len() > hint.max_num_points() {
        out.retain(|v| {
            let l = v.log10();
            (l - l.round()).abs() < 1e-9
        });
    }
    out
}

impl ValueFormatter<f64> for YAxis {
    fn format(value: &f64) -> String {
        fmt_num(*value)
    }
}

/// Check a value for `--log-y`, naming the row if it is not positive.
pub(crate) fn check_log(table: &Table, row: &table::Row, col: &str, v: f64) -> Result<()> {
    if v <= 0.0 {
        bail!(
            "{}:{}: column {col:?} is {v}, but --log-y needs every plotted value > 0 \
             (drop --log-y or filter the row out)",
            table.path.display(),
            row.line
        );
    }
    Ok(())
}

/// Draw the legend in the upper corner over the lower data: upper left when
/// the data's left edge peaks lower than its right (`left_max`,
/// `right_max`), else upper right.
pub(crate) fn legend<'a, DB: DrawingBackend + 'a, X: Ranged, Y: Ranged>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<X, Y>>,
    left_max: f64,
    right_max: f64,
) -> Result<()> {
    let position = if left_max < right_max {
        SeriesLabelPosition::UpperLeft
    } else {
        SeriesLabelPosition::UpperRight
    };
    chart
        .configure_series_labels()
        .position(position)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.5))
        .label_font((FONT, 14))
        .draw()
        .map_err(draw_err)
}

#[cfg(test)]
pub(crate) mod testutil {
    use super::*;

    /// Write `text` to a fresh temp dir as `name`; keep the dir alive.
    pub fn csv(name: &str, text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        (dir, p)
    }

    /// Parse a `distmind plot ...` command line (without `distmind plot`).
    pub fn parse(args: &[&str]) -> PlotCommand {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(subcommand)]
            cmd: PlotCommand,
        }
        let mut v = vec!["plot"];
        v.extend_from_slice(args);
        Cli::try_parse_from(v).unwrap().cmd
    }

    /// Draw into an in-memory RGB buffer; return the number of distinct
    /// colours.
    pub fn distinct_colours(
        w: u32,
        h: u32,
        f: impl FnOnce(&DrawingArea<BitMapBackend<'_>, Shift>) -> Result<()>,
    ) -> usize {
        let mut buf = vec![0u8; (w * h * 3) as usize];
        {
            let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
            f(&root).unwrap();
            root.present().unwrap();
        }
        let set: std::collections::HashSet<&[u8]> = buf.chunks(3).collect();
        set.len()
    }

    /// Width and height from a PNG file's IHDR, after checking the magic.
    pub fn png_size(path: &Path) -> (u32, u32) {
        let b = std::fs::read(path).unwrap();
        assert_eq!(
            &b[..8],
            b"\x89PNG\r\n\x1a\n",
            "not a PNG: {}",
            path.display()
        );
        assert_eq!(&b[12..16], b"IHDR");
        let be = |i: usize| u32::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        (be(16), be(20))
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::*;
    use super::*;

    fn table(text: &str) -> Table {
        Table::parse(Path::new("r.csv"), text).unwrap()
    }

    #[test]
    fn caption_sim_lists_profiles() {
        let t = table("executor,profile,v\nsim,h200,1\nsim,a100,2\nsim,h200,3\n");
        assert_eq!(
            executor_caption(&t, None).unwrap(),
            "GPU time simulated from h200, a100"
        );
        assert_eq!(
            executor_caption(&t, Some("3 runs")).unwrap(),
            "GPU time simulated from h200, a100 | 3 runs"
        );
    }

    #[test]
    fn caption_cpu_cuda_and_mixed() {
        let t = table("executor,profile,v\ncpu,,1\n");
        assert_eq!(
            executor_caption(&t, None).unwrap(),
            "executor: cpu (real model math on this CPU)"
        );
        let t = table("executor,profile,v\ncuda,h200,1\n");
        assert_eq!(
            executor_caption(&t, None).unwrap(),
            "executor: cuda (measured on a GPU)"
        );
        let t = table("executor,profile,v\ncpu,,1\nsim,h200,2\ncuda,,3\n");
        assert_eq!(
            executor_caption(&t, Some("x")).unwrap(),
            "executor: cpu (real model math on this CPU); \
             GPU time simulated from h200; executor: cuda (measured on a GPU) | x"
        );
    }

    #[test]
    fn caption_needs_executor_and_profile_columns() {
        let t = table("profile,v\nh200,1\n");
        let e = executor_caption(&t, None).unwrap_err().to_string();
        assert!(e.contains("r.csv") && e.contains("\"executor\""), "{e}");
        let t = table("executor,v\nsim,1\n");
        let e = executor_caption(&t, None).unwrap_err().to_string();
        assert!(e.contains("\"profile\""), "{e}");
    }

    #[test]
    fn missing_font_error_names_paths_and_the_fix() {
        let e = find_font(None, &["/nonexistent/a.ttf", "/nonexistent/b.ttf"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/a.ttf, /nonexistent/b.ttf"), "{e}");
        assert!(e.contains("apt-get install fonts-dejavu-core"), "{e}");
        assert!(e.contains("DISTMIND_FONT"), "{e}");
        let e = find_font(Some("/nonexistent/c.ttf".into()), DEFAULT_FONTS)
            .unwrap_err()
            .to_string();
        assert!(e.contains("DISTMIND_FONT") && e.contains("c.ttf"), "{e}");
    }

    #[test]
    fn font_is_available() {
        // Not skipped when missing: the error says what to install.
        ensure_font().unwrap();
    }

    #[test]
    fn number_format_is_short() {
        assert_eq!(fmt_num(0.0), "0");
        assert_eq!(fmt_num(0.30000000000000004), "0.3");
        assert_eq!(fmt_num(12.5), "12.5");
        assert_eq!(fmt_num(1234.56), "1234.6");
        assert_eq!(fmt_num(1e-4), "1e-4");
        assert_eq!(fmt_num(2.5e7), "2.5e7");
    }

    #[test]
    fn output_must_be_png() {
        let PlotCommand::Bars(a) = parse(&[
            "bars", "--csv", "r.csv", "--out", "fig.jpg", "--x", "m", "--y", "v",
        ]) else {
            unreachable!()
        };
        assert!(run(&PlotCommand::Bars(a))
            .unwrap_err()
            .to_string()
            .contains(".png"));
    }
}
