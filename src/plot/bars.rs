//! `distmind plot bars`: grouped bars, optional whiskers and a reference
//! ("bound") series drawn as dashed lines.

use std::collections::HashMap;
use std::ops::Range;

use anyhow::{bail, Result};
use plotters::coord::ranged1d::{KeyPointHint, NoDefaultFormatting, Ranged, ValueFormatter};
use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::table::{self, Row, Table};
use super::{
    check_log, color, draw_err, executor_caption, fmt_num, frame, legend, BarsArgs, Labels, YAxis,
    FONT,
};

/// One bar (already averaged over its rows).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Bar {
    pub y: f64,
    /// Whisker (low, high), when asked for.
    pub whisker: Option<(f64, f64)>,
}

/// Where the reference series is drawn.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum RefLines {
    /// One dashed line inside each category that has a value.
    PerCategory(Vec<Option<f64>>),
    /// One dashed line across the whole chart.
    Across(f64),
}

/// Everything `draw` needs, computed from the CSV by `prepare`.
#[derive(Debug, Clone)]
pub(crate) struct BarsFigure {
    pub labels: Labels,
    pub categories: Vec<String>,
    /// (series name, one optional bar per category).
    pub series: Vec<(String, Vec<Option<Bar>>)>,
    /// (legend label, lines).
    pub reference: Option<(String, RefLines)>,
    pub log_y: bool,
    pub warnings: Vec<String>,
}

/// Mean of the values parsed from `rows`.
fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

fn lines_of(rows: &[&Row]) -> String {
    rows.iter()
        .map(|r| r.line.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Read the CSV and work out categories, series, bars and the reference.
pub(crate) fn prepare(a: &BarsArgs) -> Result<BarsFigure> {
    let c = &a.common;
    let mut t = Table::read(&c.csv)?;
    t.apply_filters(&c.filters)?;
    let xc = t.col(&a.x)?;
    let yc = t.col(&a.y)?;
    let sc = a.series.as_deref().map(|s| t.col(s)).transpose()?;
    let whisker_cols = match (&a.whisker_low, &a.whisker_high) {
        (Some(l), Some(h)) => Some((t.col(l)?, l.as_str(), t.col(h)?, h.as_str())),
        (None, None) => None,
        _ => bail!("--whisker-low and --whisker-high go together"),
    };
    let series_of = |r: &Row| -> String {
        match sc {
            Some(sc) => r.fields[sc].clone(),
            None => a.y.clone(),
        }
    };
    let present = table::distinct(t.rows.iter().map(|r| match sc {
        Some(sc) => r.fields[sc].as_str(),
        None => a.y.as_str(),
    }));
    let reference = a.reference.clone();
    if let Some(rv) = &reference {
        if !present.contains(rv) {
            bail!(
                "{}: --reference {rv:?} is not a value of column {:?} in the plotted rows \
                 (values: {})",
                t.path.display(),
                a.series.as_deref().unwrap_or_default(),
                present.join(", ")
            );
        }
    }
    let mut order: Vec<String> = present
        .iter()
        .filter(|s| Some(*s) != reference.as_ref())
        .cloned()
        .collect();
    if let Some(want) = &a.series_order {
        for s in want {
            if !present.contains(s) {
                bail!(
                    "{}: --series-order names {s:?}, which column {:?} does not hold in the \
                     plotted rows (values: {})",
                    t.path.display(),
                    a.series.as_deref().unwrap_or_default(),
                    present.join(", ")
                );
            }
        }
        order = want
            .iter()
            .filter(|s| Some(*s) != reference.as_ref())
            .cloned()
            .collect();
        order.dedup();
    }
    // The rows this figure draws: the ordered series plus the reference.
    t.rows.retain(|r| {
        let s = series_of(r);
        order.contains(&s) || Some(&s) == reference.as_ref()
    });
    let is_ref = |r: &Row| reference.as_ref() == Some(&series_of(r));
    let categories = table::distinct(
        t.rows
            .iter()
            .filter(|r| !is_ref(r))
            .map(|r| r.fields[xc].as_str()),
    );
    if categories.is_empty() {
        bail!(
            "{}: no rows to draw as bars (only the reference series {:?} is left)",
            t.path.display(),
            reference.unwrap_or_default()
        );
    }
    let caption = executor_caption(&t, c.caption.as_deref())?;
    let mut warnings = Vec::new();

    // Group the bar rows by (category, series).
    let mut groups: HashMap<(usize, usize), Vec<&Row>> = HashMap::new();
    for r in t.rows.iter().filter(|r| !is_ref(r)) {
        let ci = categories.iter().position(|x| *x == r.fields[xc]);
        let si = order.iter().position(|s| *s == series_of(r));
        if let (Some(ci), Some(si)) = (ci, si) {
            groups.entry((ci, si)).or_default().push(r);
        }
    }
    let value = |r: &Row, col: usize, name: &str| -> Result<f64> {
        let v = t.num(r, col, name)?;
        if c.log_y {
            check_log(&t, r, name, v)?;
        }
        Ok(v)
    };
    let mut series = Vec::new();
    for (si, name) in order.iter().enumerate() {
        let mut bars = Vec::new();
        for (ci, cat) in categories.iter().enumerate() {
            let Some(rows) = groups.get(&(ci, si)) else {
                bars.push(None);
                continue;
            };
            let ys = rows
                .iter()
                .map(|r| value(r, yc, &a.y))
                .collect::<Result<Vec<_>>>()?;
            let whisker = match whisker_cols {
                Some((lc, ln, hc, hn)) => {
                    let lo = rows
                        .iter()
                        .map(|r| value(r, lc, ln))
                        .collect::<Result<Vec<_>>>()?;
                    let hi = rows
                        .iter()
                        .map(|r| value(r, hc, hn))
                        .collect::<Result<Vec<_>>>()?;
                    Some((mean(&lo), mean(&hi)))
                }
                None => None,
            };
            if rows.len() > 1 {
                warnings.push(format!(
                    "{}: {} rows for {}={cat:?}, series {name:?} (lines {}): plotting the mean",
                    t.path.display(),
                    rows.len(),
                    a.x,
                    lines_of(rows)
                ));
            }
            bars.push(Some(Bar {
                y: mean(&ys),
                whisker,
            }));
        }
        series.push((name.clone(), bars));
    }

    // The reference: one value per x it has.
    let reference = match &reference {
        None => None,
        Some(rv) => {
            let mut xs: Vec<String> = Vec::new();
            let mut by_x: Vec<Vec<&Row>> = Vec::new();
            for r in t.rows.iter().filter(|r| is_ref(r)) {
                match xs.iter().position(|x| *x == r.fields[xc]) {
                    Some(i) => by_x[i].push(r),
                    None => {
                        xs.push(r.fields[xc].clone());
                        by_x.push(vec![r]);
                    }
                }
            }
            let mut vals = Vec::new();
            for (x, rows) in xs.iter().zip(&by_x) {
                let ys = rows
                    .iter()
                    .map(|r| value(r, yc, &a.y))
                    .collect::<Result<Vec<_>>>()?;
                if rows.len() > 1 {
                    warnings.push(format!(
                        "{}: {} rows for {}={x:?} of the reference {rv:?} (lines {}): \
                         plotting the mean",
                        t.path.display(),
                        rows.len(),
                        a.x,
                        lines_of(rows)
                    ));
                }
                vals.push(mean(&ys));
            }
            let all_match = xs.iter().all(|x| categories.contains(x));
            let lines = if xs.len() == 1 {
                RefLines::Across(vals[0])
            } else if all_match {
                RefLines::PerCategory(
                    categories
                        .iter()
                        .map(|c| xs.iter().position(|x| x == c).map(|i| vals[i]))
                        .collect(),
                )
            } else {
                let stray: Vec<&str> = xs
                    .iter()
                    .filter(|x| !categories.contains(x))
                    .map(|x| x.as_str())
                    .collect();
                bail!(
                    "{}: the reference {rv:?} has {} values, for {}= {}, which are not all \
                     categories of the chart ({}); filter it to one row to draw it across the \
                     chart, or to the chart's categories",
                    t.path.display(),
                    xs.len(),
                    a.x,
                    stray.join(", "),
                    categories.join(", ")
                );
            };
            Some((format!("{rv} (bound)"), lines))
        }
    };

    Ok(BarsFigure {
        labels: Labels {
            title: c.title.clone(),
            x_label: c.x_label.clone().unwrap_or_else(|| a.x.clone()),
            y_label: c.y_label.clone().unwrap_or_else(|| a.y.clone()),
            caption,
        },
        categories,
        series,
        reference,
        log_y: c.log_y,
        warnings,
    })
}

/// The x axis of a bar chart: category `i` spans `i..i+1`, its label sits
/// at `i + 0.5`.
#[derive(Clone)]
struct CategoryAxis {
    names: Vec<String>,
}

impl Ranged for CategoryAxis {
    type FormatOption = NoDefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let n = self.names.len().max(1) as f64;
        limit.0 + ((limit.1 - limit.0) as f64 * value / n).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        if !hint.weight().allow_light_points() || hint.max_num_points() == 0 {
            // Label every category; no light mesh lines.
            (0..self.names.len()).map(|i| i as f64 + 0.5).collect()
        } else {
            Vec::new()
        }
    }

    fn range(&self) -> Range<f64> {
        0.0..self.names.len() as f64
    }
}

impl ValueFormatter<f64> for CategoryAxis {
    fn format_ext(&self, value: &f64) -> String {
        let i = value.floor().max(0.0) as usize;
        self.names.get(i).cloned().unwrap_or_default()
    }
}

/// Draw the figure onto `root`.
pub(crate) fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    fig: &BarsFigure,
) -> Result<()> {
    let area = frame(root, &fig.labels.caption)?;
    let mut values: Vec<f64> = Vec::new();
    for (_, bars) in &fig.series {
        for b in bars.iter().flatten() {
            values.push(b.y);
            if let Some((l, h)) = b.whisker {
                values.extend([l, h]);
            }
        }
    }
    match &fig.reference {
        Some((_, RefLines::Across(v))) => values.push(*v),
        Some((_, RefLines::PerCategory(vs))) => values.extend(vs.iter().flatten()),
        None => {}
    }
    let y = YAxis::fit(&values, fig.log_y);
    let base = y.baseline();
    let n = fig.categories.len();
    let x = CategoryAxis {
        names: fig.categories.clone(),
    };

    let mut builder = ChartBuilder::on(&area);
    builder
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70);
    if let Some(t) = &fig.labels.title {
        builder.caption(t, (FONT, 22));
    }
    let mut chart = builder.build_cartesian_2d(x, y).map_err(draw_err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .max_light_lines(1)
        .x_labels(n)
        .y_labels(10)
        .x_desc(fig.labels.x_label.as_str())
        .y_desc(fig.labels.y_label.as_str())
        .axis_desc_style((FONT, 16))
        .label_style((FONT, 13))
        .draw()
        .map_err(draw_err)?;

    // Bars: the group fills 80% of its category.
    let ns = fig.series.len().max(1);
    let bw = 0.8 / ns as f64;
    let centre = |ci: usize, si: usize| ci as f64 + 0.1 + bw * (si as f64 + 0.5);
    let (px, _) = chart.plotting_area().get_pixel_range();
    let bar_px = (px.end - px.start) as f64 / n.max(1) as f64 * bw;
    let value_font = TextStyle::from((FONT, 11).into_font())
        .pos(Pos::new(HPos::Center, VPos::Bottom))
        .color(&RGBColor(40, 40, 40));
    for (si, (name, bars)) in fig.series.iter().enumerate() {
        let col = color(si);
        let rects = bars.iter().enumerate().filter_map(|(ci, b)| {
            b.map(|b| {
                let c = centre(ci, si);
                Rectangle::new([(c - bw * 0.46, base), (c + bw * 0.46, b.y)], col.filled())
            })
        });
        chart
            .draw_series(rects)
            .map_err(draw_err)?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], col.filled()));
    }
    // Whiskers and values, over the bars.
    let ink = RGBColor(30, 30, 30).stroke_width(2);
    for (si, (_, bars)) in fig.series.iter().enumerate() {
        for (ci, b) in bars.iter().enumerate() {
            let Some(b) = b else { continue };
            let c = centre(ci, si);
            let mut top = b.y;
            if let Some((lo, hi)) = b.whisker {
                let cap = bw * 0.18;
                chart
                    .draw_series([
                        PathElement::new(vec![(c, lo), (c, hi)], ink),
                        PathElement::new(vec![(c - cap, lo), (c + cap, lo)], ink),
                        PathElement::new(vec![(c - cap, hi), (c + cap, hi)], ink),
                    ])
                    .map_err(draw_err)?;
                top = top.max(hi);
            }
            if bar_px >= 26.0 {
                chart
                    .draw_series(std::iter::once(
                        EmptyElement::at((c, top))
                            + Text::new(fmt_num(b.y), (0, -3), value_font.clone()),
                    ))
                    .map_err(draw_err)?;
            }
        }
    }
    if let Some((label, lines)) = &fig.reference {
        let style = BLACK.stroke_width(2);
        let segs: Vec<(f64, f64, f64)> = match lines {
            RefLines::Across(v) => vec![(0.0, n as f64, *v)],
            RefLines::PerCategory(vs) => vs
                .iter()
                .enumerate()
                .filter_map(|(ci, v)| v.map(|v| (ci as f64 + 0.04, ci as f64 + 0.96, v)))
                .collect(),
        };
        chart
            .draw_series(
                segs.into_iter()
                    .map(|(a, b, v)| DashedPathElement::new(vec![(a, v), (b, v)], 9, 5, style)),
            )
            .map_err(draw_err)?
            .label(label.as_str())
            .legend(move |(x, y)| DashedPathElement::new(vec![(x, y), (x + 18, y)], 5, 3, style));
    }
    if fig.series.len() > 1 || fig.reference.is_some() {
        // The tallest thing in the first and in the last category.
        let peak = |ci: usize| {
            let mut m = f64::NEG_INFINITY;
            for (_, bars) in &fig.series {
                if let Some(b) = bars[ci] {
                    m = m.max(b.y).max(b.whisker.map_or(b.y, |w| w.1));
                }
            }
            match &fig.reference {
                Some((_, RefLines::Across(v))) => m.max(*v),
                Some((_, RefLines::PerCategory(vs))) => m.max(vs[ci].unwrap_or(m)),
                None => m,
            }
        };
        legend(&mut chart, peak(0), peak(n - 1))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::super::{run, PlotCommand};
    use super::*;

    const CSV: &str = "\
experiment,model,system,executor,profile,mean_ms,p50_ms,p99_ms
e1,resnet50,distmind,sim,h200,12.0,11.0,20.0
e1,resnet50,baseline,sim,h200,30.0,28.0,45.0
e1,bert,distmind,sim,h200,18.0,17.0,25.0
e1,bert,baseline,sim,h200,40.0,39.0,60.0
e1,bert,distmind,sim,h200,20.0,19.0,27.0
e1,resnet50,gpu,sim,h200,9.0,9.0,9.5
e1,bert,gpu,sim,h200,14.0,14.0,15.0
e2,resnet50,distmind,cpu,,5.0,4.0,6.0
";

    fn bars_args(cmd: PlotCommand) -> BarsArgs {
        match cmd {
            PlotCommand::Bars(a) => a,
            _ => unreachable!(),
        }
    }

    fn args(csv: &std::path::Path, out: &std::path::Path, extra: &[&str]) -> BarsArgs {
        let mut v = vec![
            "bars",
            "--csv",
            csv.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--x",
            "model",
            "--series",
            "system",
            "--y",
            "mean_ms",
        ];
        v.extend_from_slice(extra);
        bars_args(parse(&v))
    }

    #[test]
    fn groups_averages_and_reference_per_category() {
        let (dir, csv) = csv("r.csv", CSV);
        let a = args(
            &csv,
            &dir.path().join("f.png"),
            &[
                "--filter",
                "experiment=e1",
                "--whisker-low",
                "p50_ms",
                "--whisker-high",
                "p99_ms",
                "--reference",
                "gpu",
            ],
        );
        let fig = prepare(&a).unwrap();
        assert_eq!(fig.categories, ["resnet50", "bert"]);
        let names: Vec<&str> = fig.series.iter().map(|s| s.0.as_str()).collect();
        assert_eq!(names, ["distmind", "baseline"]);
        // bert/distmind has two rows: the mean, with a warning naming them.
        let b = fig.series[0].1[1].unwrap();
        assert_eq!(b.y, 19.0);
        assert_eq!(b.whisker, Some((18.0, 26.0)));
        assert_eq!(fig.warnings.len(), 1);
        assert!(
            fig.warnings[0].contains("lines 4, 6"),
            "{}",
            fig.warnings[0]
        );
        assert_eq!(
            fig.reference,
            Some((
                "gpu (bound)".to_string(),
                RefLines::PerCategory(vec![Some(9.0), Some(14.0)])
            ))
        );
        assert_eq!(fig.labels.caption, "GPU time simulated from h200");
    }

    #[test]
    fn series_order_and_single_reference_across() {
        let text = "model,system,executor,profile,v\n\
                    a,x,cuda,,1\na,y,cuda,,2\nb,x,cuda,,3\nb,z,cuda,,5\nall,gpu,cuda,,4\n";
        let (dir, csv) = csv("r.csv", text);
        let out = dir.path().join("f.png");
        let mut v = vec![
            "bars",
            "--csv",
            csv.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--x",
            "model",
            "--series",
            "system",
            "--y",
            "v",
            "--series-order",
            "y,x",
            "--reference",
            "gpu",
        ];
        let fig = prepare(&bars_args(parse(&v))).unwrap();
        let names: Vec<&str> = fig.series.iter().map(|s| s.0.as_str()).collect();
        assert_eq!(names, ["y", "x"]);
        assert_eq!(
            fig.series[0].1,
            vec![
                Some(Bar {
                    y: 2.0,
                    whisker: None
                }),
                None
            ]
        );
        assert_eq!(fig.reference.unwrap().1, RefLines::Across(4.0));
        assert_eq!(fig.labels.caption, "executor: cuda (measured on a GPU)");
        v[12] = "y,nope";
        let e = prepare(&bars_args(parse(&v))).unwrap_err().to_string();
        assert!(e.contains("\"nope\"") && e.contains("x, y, z, gpu"), "{e}");
    }

    #[test]
    fn log_y_rejects_zero_naming_the_row() {
        let text = "model,executor,profile,v\na,sim,h200,3\nb,sim,h200,0\n";
        let (dir, csv) = csv("r.csv", text);
        let out = dir.path().join("f.png");
        let a = bars_args(parse(&[
            "bars",
            "--csv",
            csv.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--x",
            "model",
            "--y",
            "v",
            "--log-y",
        ]));
        let e = run(&PlotCommand::Bars(a)).unwrap_err().to_string();
        assert!(
            e.contains("r.csv:3") && e.contains("\"v\"") && e.contains("--log-y"),
            "{e}"
        );
        assert!(!out.exists());
    }

    #[test]
    fn renders_into_a_buffer() {
        let (dir, csv) = csv("r.csv", CSV);
        let a = args(
            &csv,
            &dir.path().join("f.png"),
            &[
                "--filter",
                "experiment=e1",
                "--whisker-low",
                "p50_ms",
                "--whisker-high",
                "p99_ms",
                "--reference",
                "gpu",
                "--title",
                "Latency",
            ],
        );
        let fig = prepare(&a).unwrap();
        let colours = distinct_colours(800, 500, |root| draw(root, &fig));
        assert!(colours > 8, "only {colours} colours");
        let mut log = a.clone();
        log.common.log_y = true;
        let fig = prepare(&log).unwrap();
        assert!(distinct_colours(800, 500, |root| draw(root, &fig)) > 8);
    }

    #[test]
    fn writes_a_png_file() {
        let (dir, csv) = csv("r.csv", CSV);
        let out = dir.path().join("figs/bars.png");
        let a = args(&csv, &out, &["--width", "640", "--height", "400"]);
        run(&PlotCommand::Bars(a)).unwrap();
        assert_eq!(png_size(&out), (640, 400));
    }
}
