//! The JSON path (`sync.preduce.ssp_bound`, `partition[2]`) at a position of
//! a JSON text: serde_json reports where it failed as a line and column,
//! and a spec's errors name the field instead.
//!
//! A small scanner over the text up to that position: it tracks the open
//! objects (with the key last read) and arrays (with the element index).
//! It needs no valid JSON after the position and tolerates any before it
//! (on garbage the path is just less precise).

/// One open container.
enum Frame {
    Object { key: Option<String> },
    Array { index: usize },
}

/// The path of the value being read at (`line`, `column`), both 1-based as
/// serde_json counts them (the column is the byte of the line last read).
/// Empty at the top level.
pub(super) fn at(text: &str, line: usize, column: usize) -> String {
    let end = offset(text, line, column);
    let bytes = text.as_bytes();
    let mut stack: Vec<Frame> = Vec::new();
    // Whether the next string in the innermost object is a key.
    let mut expect_key = false;
    let mut i = 0;
    while i < end {
        match bytes[i] {
            b'"' => {
                let start = i;
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    i += if bytes[i] == b'\\' { 2 } else { 1 };
                }
                let raw = &text[start..(i + 1).min(text.len())];
                if expect_key {
                    if let Some(Frame::Object { key }) = stack.last_mut() {
                        *key = Some(
                            serde_json::from_str::<String>(raw)
                                .unwrap_or_else(|_| raw.trim_matches('"').to_string()),
                        );
                    }
                    expect_key = false;
                }
            }
            b'{' => {
                stack.push(Frame::Object { key: None });
                expect_key = true;
            }
            b'[' => {
                stack.push(Frame::Array { index: 0 });
                expect_key = false;
            }
            b'}' | b']' => {
                stack.pop();
                expect_key = false;
            }
            b',' => match stack.last_mut() {
                Some(Frame::Array { index }) => *index += 1,
                Some(Frame::Object { .. }) => expect_key = true,
                None => {}
            },
            _ => {}
        }
        i += 1;
    }
    let mut path = String::new();
    for f in &stack {
        match f {
            Frame::Object { key: Some(k) } => {
                if !path.is_empty() {
                    path.push('.');
                }
                path.push_str(k);
            }
            Frame::Object { key: None } => break,
            Frame::Array { index } => path.push_str(&format!("[{index}]")),
        }
    }
    path
}

/// The byte offset just past (`line`, `column`), clamped to the text.
fn offset(text: &str, line: usize, column: usize) -> usize {
    let mut start = 0;
    for _ in 1..line {
        match text[start..].find('\n') {
            Some(n) => start += n + 1,
            None => return text.len(),
        }
    }
    (start + column).min(text.len())
}
