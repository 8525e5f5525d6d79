//! `distmind plot lines`: lines with marked points over a numeric x, or
//! stacked areas (`--stacked`).

use anyhow::{bail, Result};
use plotters::coord::Shift;
use plotters::prelude::*;

use super::table::{Row, Table};
use super::{
    check_log, color, draw_err, executor_caption, fmt_num, frame, legend, Labels, LinesArgs, YAxis,
    FONT,
};

/// Everything `draw` needs, computed from the CSV by `prepare`.
#[derive(Debug, Clone)]
pub(crate) struct LinesFigure {
    pub labels: Labels,
    /// (name, points sorted by x, one per distinct x).
    pub series: Vec<(String, Vec<(f64, f64)>)>,
    /// For `--stacked`: the union of x values and, per series, the running
    /// sum (the top edge of its band) at each of them.
    pub stack: Option<(Vec<f64>, Vec<Vec<f64>>)>,
    pub log_y: bool,
    pub warnings: Vec<String>,
}

/// Read the CSV and build the series.
pub(crate) fn prepare(a: &LinesArgs) -> Result<LinesFigure> {
    let c = &a.common;
    let mut t = Table::read(&c.csv)?;
    t.apply_filters(&c.filters)?;
    if a.series.is_some() && a.y.len() > 1 {
        bail!(
            "--series splits one --y column; got {} --y columns",
            a.y.len()
        );
    }
    let xc = t.col(&a.x)?;
    let ycs =
        a.y.iter()
            .map(|y| Ok((t.col(y)?, y.as_str())))
            .collect::<Result<Vec<_>>>()?;
    let caption = executor_caption(&t, c.caption.as_deref())?;
    let point = |r: &Row, yc: usize, yn: &str| -> Result<(f64, f64)> {
        let x = t.num(r, xc, &a.x)?;
        let y = t.num(r, yc, yn)?;
        if c.log_y {
            check_log(&t, r, yn, y)?;
        }
        Ok((x, y))
    };
    let mut raw: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    match &a.series {
        Some(s) => {
            let sc = t.col(s)?;
            let (yc, yn) = ycs[0];
            for name in t.distinct(sc) {
                let pts = t
                    .rows
                    .iter()
                    .filter(|r| r.fields[sc] == name)
                    .map(|r| point(r, yc, yn))
                    .collect::<Result<Vec<_>>>()?;
                raw.push((name, pts));
            }
        }
        None => {
            for &(yc, yn) in &ycs {
                let pts = t
                    .rows
                    .iter()
                    .map(|r| point(r, yc, yn))
                    .collect::<Result<Vec<_>>>()?;
                raw.push((yn.to_string(), pts));
            }
        }
    }

    let mut warnings = Vec::new();
    let mut series = Vec::new();
    for (name, mut pts) in raw {
        pts.sort_by(|p, q| p.0.total_cmp(&q.0));
        let mut merged: Vec<(f64, f64, usize)> = Vec::new();
        for (x, y) in pts {
            match merged.last_mut() {
                Some(m) if m.0 == x => {
                    m.1 += y;
                    m.2 += 1;
                }
                _ => merged.push((x, y, 1)),
            }
        }
        let dups = merged.iter().filter(|m| m.2 > 1).count();
        if dups > 0 {
            warnings.push(format!(
                "{}: series {name:?} has several rows at {dups} x value(s): plotting their mean",
                t.path.display()
            ));
        }
        let pts: Vec<(f64, f64)> = merged
            .into_iter()
            .map(|(x, y, n)| (x, y / n as f64))
            .collect();
        series.push((name, pts));
    }

    let stack = if a.stacked {
        let mut xs: Vec<f64> = series
            .iter()
            .flat_map(|(_, p)| p.iter().map(|q| q.0))
            .collect();
        xs.sort_by(f64::total_cmp);
        xs.dedup();
        let mut sums = vec![0.0; xs.len()];
        let mut tops = Vec::new();
        for (name, pts) in &series {
            let mut missing = 0;
            for (i, x) in xs.iter().enumerate() {
                match pts.iter().find(|p| p.0 == *x) {
                    Some(p) => sums[i] += p.1,
                    None => missing += 1,
                }
            }
            if missing > 0 {
                warnings.push(format!(
                    "{}: --stacked: series {name:?} has no row at {missing} of the {} x values; \
                     counted as 0 there",
                    t.path.display(),
                    xs.len()
                ));
            }
            tops.push(sums.clone());
        }
        Some((xs, tops))
    } else {
        None
    };

    Ok(LinesFigure {
        labels: Labels {
            title: c.title.clone(),
            x_label: c.x_label.clone().unwrap_or_else(|| a.x.clone()),
            y_label: c.y_label.clone().unwrap_or_else(|| a.y.join(", ")),
            caption,
        },
        series,
        stack,
        log_y: c.log_y,
        warnings,
    })
}

/// A colour channel at 75% over white.
fn blend(c: u8) -> u8 {
    (f64::from(c) * 0.75 + 255.0 * 0.25).round() as u8
}

/// Draw the figure onto `root`.
pub(crate) fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    fig: &LinesFigure,
) -> Result<()> {
    let area = frame(root, &fig.labels.caption)?;
    let values: Vec<f64> = match &fig.stack {
        Some((_, tops)) => tops.iter().flatten().copied().collect(),
        None => fig
            .series
            .iter()
            .flat_map(|(_, p)| p.iter().map(|q| q.1))
            .collect(),
    };
    let y = YAxis::fit(&values, fig.log_y);
    let base = y.baseline();
    let xs = fig.series.iter().flat_map(|(_, p)| p.iter().map(|q| q.0));
    let (mut x0, mut x1) = xs.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
        (lo.min(x), hi.max(x))
    });
    if !x0.is_finite() {
        (x0, x1) = (0.0, 1.0);
    } else if x0 == x1 {
        let pad = if x0 == 0.0 { 1.0 } else { x0.abs() * 0.1 };
        (x0, x1) = (x0 - pad, x1 + pad);
    }

    let mut builder = ChartBuilder::on(&area);
    builder
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70);
    if let Some(t) = &fig.labels.title {
        builder.caption(t, (FONT, 22));
    }
    let mut chart = builder.build_cartesian_2d(x0..x1, y).map_err(draw_err)?;
    let fmt = |v: &f64| fmt_num(*v);
    chart
        .configure_mesh()
        .max_light_lines(1)
        .x_labels(10)
        .y_labels(10)
        .x_label_formatter(&fmt)
        .x_desc(fig.labels.x_label.as_str())
        .y_desc(fig.labels.y_label.as_str())
        .axis_desc_style((FONT, 16))
        .label_style((FONT, 13))
        .draw()
        .map_err(draw_err)?;

    match &fig.stack {
        Some((xs, tops)) => {
            for (k, ((name, _), top)) in fig.series.iter().zip(tops).enumerate() {
                let col = color(k);
                // Opaque (pre-blended with white), so the grid stays behind.
                let fill = RGBColor(blend(col.0), blend(col.1), blend(col.2));
                let below: Vec<f64> = if k == 0 {
                    vec![base; xs.len()]
                } else {
                    tops[k - 1].clone()
                };
                let mut band: Vec<(f64, f64)> =
                    xs.iter().copied().zip(top.iter().copied()).collect();
                band.extend(xs.iter().copied().zip(below).rev());
                chart
                    .draw_series(std::iter::once(Polygon::new(band, fill.filled())))
                    .map_err(draw_err)?
                    .label(name.as_str())
                    .legend(move |(x, y)| {
                        Rectangle::new([(x, y - 6), (x + 14, y + 6)], fill.filled())
                    });
                chart
                    .draw_series(LineSeries::new(
                        xs.iter().copied().zip(top.iter().copied()),
                        col.stroke_width(2),
                    ))
                    .map_err(draw_err)?;
            }
        }
        None => {
            for (k, (name, pts)) in fig.series.iter().enumerate() {
                let col = color(k);
                chart
                    .draw_series(
                        LineSeries::new(pts.iter().copied(), col.stroke_width(2)).point_size(4),
                    )
                    .map_err(draw_err)?
                    .label(name.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], col.stroke_width(3))
                    });
            }
        }
    }
    if fig.series.len() > 1 {
        // The highest point in the left and in the right quarter of x.
        let quarter = (x1 - x0) / 4.0;
        let peak = |inside: &dyn Fn(f64) -> bool| -> f64 {
            let mut m = f64::NEG_INFINITY;
            match &fig.stack {
                Some((xs, tops)) => {
                    let last = &tops[tops.len() - 1];
                    for (x, y) in xs.iter().zip(last) {
                        if inside(*x) {
                            m = m.max(*y);
                        }
                    }
                }
                None => {
                    for (x, y) in fig.series.iter().flat_map(|(_, p)| p.iter()) {
                        if inside(*x) {
                            m = m.max(*y);
                        }
                    }
                }
            }
            m
        };
        let left = peak(&|x| x <= x0 + quarter);
        let right = peak(&|x| x >= x1 - quarter);
        legend(&mut chart, left, right)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::super::{run, PlotCommand};
    use super::*;

    const CSV: &str = "\
t_s,device,util_infer,util_train,executor,profile
0,g0,0.5,0.2,sim,h200
1,g0,0.6,0.3,sim,h200
2,g0,0.2,0.7,sim,h200
0,g1,0.1,0.1,sim,h200
1,g1,0.9,0.0,sim,h200
3,g1,0.4,0.4,sim,h200
";

    fn lines_args(v: &[&str]) -> LinesArgs {
        match parse(v) {
            PlotCommand::Lines(a) => a,
            _ => unreachable!(),
        }
    }

    #[test]
    fn y_columns_and_series_column() {
        let (dir, csv) = csv("u.csv", CSV);
        let out = dir.path().join("u.png");
        let (c, o) = (csv.to_str().unwrap(), out.to_str().unwrap());
        let a = lines_args(&[
            "lines",
            "--csv",
            c,
            "--out",
            o,
            "--x",
            "t_s",
            "--y",
            "util_infer",
            "--y",
            "util_train",
            "--filter",
            "device=g0",
        ]);
        let fig = prepare(&a).unwrap();
        assert_eq!(fig.series.len(), 2);
        assert_eq!(fig.series[1].0, "util_train");
        assert_eq!(fig.series[1].1, vec![(0.0, 0.2), (1.0, 0.3), (2.0, 0.7)]);
        assert_eq!(fig.labels.y_label, "util_infer, util_train");

        let a = lines_args(&[
            "lines",
            "--csv",
            c,
            "--out",
            o,
            "--x",
            "t_s",
            "--y",
            "util_infer",
            "--series",
            "device",
        ]);
        let fig = prepare(&a).unwrap();
        let names: Vec<&str> = fig.series.iter().map(|s| s.0.as_str()).collect();
        assert_eq!(names, ["g0", "g1"]);
        assert_eq!(fig.series[1].1[2], (3.0, 0.4));
    }

    #[test]
    fn stacked_sums_in_series_order() {
        let (dir, csv) = csv("u.csv", CSV);
        let out = dir.path().join("u.png");
        let a = lines_args(&[
            "lines",
            "--csv",
            csv.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--x",
            "t_s",
            "--y",
            "util_infer",
            "--series",
            "device",
            "--stacked",
        ]);
        let fig = prepare(&a).unwrap();
        let (xs, tops) = fig.stack.clone().unwrap();
        assert_eq!(xs, [0.0, 1.0, 2.0, 3.0]);
        assert_eq!(tops[0], [0.5, 0.6, 0.2, 0.0]);
        let want = [0.6, 1.5, 0.2, 0.4];
        for (got, want) in tops[1].iter().zip(want) {
            assert!((got - want).abs() < 1e-12, "{:?}", tops[1]);
        }
        // g0 lacks t=3 and g1 lacks t=2: both said.
        assert_eq!(fig.warnings.len(), 2, "{:?}", fig.warnings);
        assert!(distinct_colours(700, 450, |root| draw(root, &fig)) > 8);
    }

    #[test]
    fn renders_lines_and_writes_png() {
        let (dir, csv) = csv("u.csv", CSV);
        let out = dir.path().join("u.png");
        let a = lines_args(&[
            "lines",
            "--csv",
            csv.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--x",
            "t_s",
            "--y",
            "util_infer",
            "--series",
            "device",
            "--title",
            "Utilisation",
            "--y-label",
            "utilisation (fraction)",
            "--width",
            "500",
            "--height",
            "300",
        ]);
        let fig = prepare(&a).unwrap();
        assert!(distinct_colours(500, 300, |root| draw(root, &fig)) > 8);
        run(&PlotCommand::Lines(a)).unwrap();
        assert_eq!(png_size(&out), (500, 300));
    }

    #[test]
    fn log_y_zero_and_bad_numbers_are_errors() {
        let (dir, csv) = csv("u.csv", CSV);
        let out = dir.path().join("u.png");
        let (c, o) = (csv.to_str().unwrap(), out.to_str().unwrap());
        let a = lines_args(&[
            "lines",
            "--csv",
            c,
            "--out",
            o,
            "--x",
            "t_s",
            "--y",
            "util_train",
            "--log-y",
        ]);
        let e = prepare(&a).unwrap_err().to_string();
        assert!(e.contains("u.csv:6") && e.contains("\"util_train\""), "{e}");

        let a = lines_args(&[
            "lines", "--csv", c, "--out", o, "--x", "device", "--y", "t_s",
        ]);
        let e = prepare(&a).unwrap_err().to_string();
        assert!(
            e.contains("u.csv:2") && e.contains("\"device\"") && e.contains("\"g0\""),
            "{e}"
        );

        let a = lines_args(&[
            "lines",
            "--csv",
            c,
            "--out",
            o,
            "--x",
            "t_s",
            "--y",
            "util_train",
            "--filter",
            "device=g9",
        ]);
        let e = prepare(&a).unwrap_err().to_string();
        assert!(
            e.contains("--filter device=g9") && e.contains("device: [g0, g1]"),
            "{e}"
        );
    }
}
