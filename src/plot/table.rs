//! The experiment CSV as `distmind plot` reads it: a header row, then one
//! record per line, comma separated, read with the `csv` crate.
//!
//! Fields may be wrapped in double quotes (`"a,b"`, with `""` for a quote
//! inside); a quoted field cannot span lines. Blank lines are skipped and
//! fields are trimmed. Every error names the file and the 1-based line
//! number, and for numbers the column and the text that did not parse.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};

/// One `--filter COL=VALUE`: keep rows whose `column` is exactly `value`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filter {
    pub column: String,
    pub value: String,
}

impl std::str::FromStr for Filter {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once('=') {
            Some((c, v)) if !c.trim().is_empty() => Ok(Filter {
                column: c.trim().to_string(),
                value: v.to_string(),
            }),
            _ => Err(format!("expected COL=VALUE, got {s:?}")),
        }
    }
}

impl std::fmt::Display for Filter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.column, self.value)
    }
}

/// One data record and the line it came from.
#[derive(Debug, Clone)]
pub struct Row {
    /// 1-based line number in the file (the header is line 1).
    pub line: usize,
    pub fields: Vec<String>,
}

/// A parsed CSV file.
#[derive(Debug, Clone)]
pub struct Table {
    /// Where it came from, for error messages.
    pub path: PathBuf,
    pub header: Vec<String>,
    pub rows: Vec<Row>,
}

impl Table {
    /// Read and parse `path`.
    pub fn read(path: &Path) -> Result<Table> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading CSV {}", path.display()))?;
        Table::parse(path, &text)
    }

    /// Parse `text`; `path` is only used in messages.
    pub fn parse(path: &Path, text: &str) -> Result<Table> {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
        let mut reader = csv::ReaderBuilder::new()
            .has_headers(false)
            .flexible(true)
            .from_reader(text.as_bytes());
        let mut header: Option<Vec<String>> = None;
        let mut rows = Vec::new();
        // The record's line, counted here: csv's position is where the
        // previous record ended, before the empty lines it skips.
        let (bytes, mut at, mut line) = (text.as_bytes(), 0, 1);
        for record in reader.records() {
            let record = record.map_err(|e| anyhow!("{}: {e}", path.display()))?;
            let mut start = record.position().map_or(at, |p| p.byte() as usize);
            while matches!(bytes.get(start), Some(b'\r' | b'\n')) {
                start += 1;
            }
            line += bytes[at..start].iter().filter(|&&b| b == b'\n').count();
            at = start;
            // Without a closing quote, a field runs to the end of the file.
            if record.iter().any(|f| f.contains(['\n', '\r'])) {
                bail!(
                    "{}:{line}: unterminated quoted field (a quoted field cannot span lines)",
                    path.display()
                );
            }
            let fields: Vec<String> = record.iter().map(|f| f.trim().to_string()).collect();
            if fields.len() == 1 && fields[0].is_empty() {
                continue; // A line of blanks.
            }
            match &header {
                None => {
                    let mut seen = std::collections::HashSet::new();
                    for (c, name) in fields.iter().enumerate() {
                        if name.is_empty() {
                            bail!(
                                "{}:{line}: header column {} is empty",
                                path.display(),
                                c + 1
                            );
                        }
                        if !seen.insert(name.as_str()) {
                            bail!(
                                "{}:{line}: header names column {name:?} twice",
                                path.display()
                            );
                        }
                    }
                    header = Some(fields);
                }
                Some(h) => {
                    if fields.len() != h.len() {
                        bail!(
                            "{}:{line}: {} fields, but the header has {} columns",
                            path.display(),
                            fields.len(),
                            h.len()
                        );
                    }
                    rows.push(Row { line, fields });
                }
            }
        }
        let Some(header) = header else {
            bail!("{} is empty: expected a header row", path.display());
        };
        if rows.is_empty() {
            bail!("{} has a header but no data rows", path.display());
        }
        Ok(Table {
            path: path.to_path_buf(),
            header,
            rows,
        })
    }

    /// The index of column `name`, or an error naming the file and its columns.
    pub fn col(&self, name: &str) -> Result<usize> {
        self.header.iter().position(|h| h == name).ok_or_else(|| {
            anyhow!(
                "{} has no column {name:?} (columns: {})",
                self.path.display(),
                self.header.join(", ")
            )
        })
    }

    /// Parse the field of `row` in column `col` (named `name`) as a finite
    /// number.
    pub fn num(&self, row: &Row, col: usize, name: &str) -> Result<f64> {
        let text = &row.fields[col];
        match text.parse::<f64>() {
            Ok(v) if v.is_finite() => Ok(v),
            _ => bail!(
                "{}:{}: column {name:?}: cannot parse {text:?} as a finite number",
                self.path.display(),
                row.line
            ),
        }
    }

    /// Keep the rows where every filter matches exactly. If none is left,
    /// the error says which filters matched nothing on their own and lists
    /// the values the filtered columns do hold.
    pub fn apply_filters(&mut self, filters: &[Filter]) -> Result<()> {
        if filters.is_empty() {
            return Ok(());
        }
        let cols = filters
            .iter()
            .map(|f| self.col(&f.column))
            .collect::<Result<Vec<_>>>()?;
        let keep: Vec<Row> = self
            .rows
            .iter()
            .filter(|r| {
                filters
                    .iter()
                    .zip(&cols)
                    .all(|(f, &c)| r.fields[c] == f.value)
            })
            .cloned()
            .collect();
        if !keep.is_empty() {
            self.rows = keep;
            return Ok(());
        }
        let unmatched: Vec<String> = filters
            .iter()
            .zip(&cols)
            .filter(|(f, &c)| !self.rows.iter().any(|r| r.fields[c] == f.value))
            .map(|(f, _)| format!("--filter {f}"))
            .collect();
        let mut present = BTreeMap::new();
        for (f, &c) in filters.iter().zip(&cols) {
            present
                .entry(f.column.clone())
                .or_insert_with(|| self.distinct(c).join(", "));
        }
        let present: Vec<String> = present
            .into_iter()
            .map(|(c, v)| format!("{c}: [{v}]"))
            .collect();
        let what = if unmatched.is_empty() {
            "each filter matches some rows, but no row matches all of them".to_string()
        } else {
            format!("no row matches {}", unmatched.join(", "))
        };
        bail!(
            "{}: no rows left after filtering: {what}; values present: {}",
            self.path.display(),
            present.join("; ")
        )
    }

    /// Distinct values of column `col`, in order of first appearance.
    pub fn distinct(&self, col: usize) -> Vec<String> {
        distinct(self.rows.iter().map(|r| r.fields[col].as_str()))
    }
}

/// Distinct strings in order of first appearance.
pub fn distinct<'a>(values: impl IntoIterator<Item = &'a str>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for v in values {
        if !out.iter().any(|o| o == v) {
            out.push(v.to_string());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Table> {
        Table::parse(Path::new("results/t.csv"), text)
    }

    #[test]
    fn parses_header_rows_and_line_numbers() {
        let t = parse("\u{feff}a,b,c\n1,2,3\n\n 4 , x ,6\r\n  \n").unwrap();
        assert_eq!(t.header, ["a", "b", "c"]);
        assert_eq!(t.rows.len(), 2);
        assert_eq!(t.rows[1].line, 4);
        assert_eq!(t.rows[1].fields, ["4", "x", "6"]);
        assert_eq!(t.num(&t.rows[1], 0, "a").unwrap(), 4.0);
    }

    #[test]
    fn bad_number_names_file_line_column_and_text() {
        let t = parse("model,lat\nm1,1.5\nm2,fast\n").unwrap();
        let col = t.col("lat").unwrap();
        let e = t.num(&t.rows[1], col, "lat").unwrap_err().to_string();
        assert!(e.contains("results/t.csv:3"), "{e}");
        assert!(e.contains("\"lat\""), "{e}");
        assert!(e.contains("\"fast\""), "{e}");
        let e = t.num(&t.rows[0], 0, "model").unwrap_err().to_string();
        assert!(e.contains(":2:"), "{e}");
        // NaN and infinities are not numbers a figure can use.
        let t = parse("v\nNaN\n").unwrap();
        assert!(t.num(&t.rows[0], 0, "v").is_err());
    }

    #[test]
    fn missing_column_lists_columns() {
        let t = parse("a,b\n1,2\n").unwrap();
        let e = t.col("zz").unwrap_err().to_string();
        assert!(e.contains("\"zz\"") && e.contains("a, b"), "{e}");
    }

    #[test]
    fn quoted_fields_are_handled() {
        let t = parse("name,v\n\"a, b\",1\n\"say \"\"hi\"\"\" , 2\n").unwrap();
        assert_eq!(t.rows[0].fields, ["a, b", "1"]);
        assert_eq!(t.rows[1].fields, ["say \"hi\"", "2"]);
        let e = parse("name,v\n\"open,1\n").unwrap_err().to_string();
        assert!(e.contains(":2:") && e.contains("unterminated"), "{e}");
        // A quote inside an unquoted field is text, as for Python's csv.
        let t = parse("name,v\nab\"c,1\n\r\n").unwrap();
        assert_eq!(t.rows[0].fields, ["ab\"c", "1"]);
    }

    #[test]
    fn ragged_and_empty_files_are_rejected() {
        let e = parse("a,b\n1,2,3\n").unwrap_err().to_string();
        assert!(e.contains(":2:") && e.contains("3 fields"), "{e}");
        assert!(parse("").unwrap_err().to_string().contains("empty"));
        assert!(parse("a,b\n")
            .unwrap_err()
            .to_string()
            .contains("no data rows"));
    }

    #[test]
    fn filters_keep_matching_rows_and_explain_misses() {
        let text = "exp,model,v\nA,m1,1\nA,m2,2\nB,m1,3\n";
        let mut t = parse(text).unwrap();
        let f = |s: &str| s.parse::<Filter>().unwrap();
        t.apply_filters(&[f("exp=A"), f("model=m2")]).unwrap();
        assert_eq!(t.rows.len(), 1);
        assert_eq!(t.rows[0].line, 3);

        let mut t = parse(text).unwrap();
        let e = t
            .apply_filters(&[f("exp=C"), f("model=m1")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--filter exp=C"), "{e}");
        assert!(!e.contains("--filter model=m1"), "{e}");
        assert!(
            e.contains("exp: [A, B]") && e.contains("model: [m1, m2]"),
            "{e}"
        );

        let mut t = parse(text).unwrap();
        let e = t
            .apply_filters(&[f("exp=B"), f("model=m2")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("no row matches all"), "{e}");

        let mut t = parse(text).unwrap();
        assert!(t.apply_filters(&[f("nope=1")]).is_err());
        assert!("novalue".parse::<Filter>().is_err());
        assert_eq!(f("a=b=c").value, "b=c");
    }
}
