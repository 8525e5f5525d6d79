//! Rows in and out of a batch: the worker groups its requests by input
//! shape past dimension 0 (a transformer's requests may differ in length),
//! concatenates each group's inputs along dimension 0, runs the model once
//! per group, and gives each request back its own rows of every output.

use crate::exec::{HostTensor, TensorData};

/// Concatenates `parts` along dimension 0. Every part must have the same
/// dtype and the same shape past dimension 0 (the worker checked each
/// against the manifest); an error names the first part that differs.
pub(crate) fn concat_rows(parts: &[&HostTensor]) -> Result<HostTensor, String> {
    let Some(first) = parts.first() else {
        return Err("a batch of no requests".into());
    };
    let Some((_, trailing)) = first.shape.split_first() else {
        return Err(format!(
            "the input is a scalar ({}); only inputs with a batch dimension batch",
            first.describe()
        ));
    };
    let mut rows = 0usize;
    for (k, p) in parts.iter().enumerate() {
        let same = p.dtype_name() == first.dtype_name()
            && p.shape.split_first().is_some_and(|(_, t)| t == trailing);
        if !same {
            return Err(format!(
                "batch input {k} is {}, input 0 is {}: only dimension 0 may differ",
                p.describe(),
                first.describe()
            ));
        }
        rows += p.shape[0];
    }
    let mut shape = first.shape.clone();
    shape[0] = rows;
    Ok(match &first.data {
        TensorData::F32(_) => HostTensor::f32(
            shape,
            concat(parts, |t| match &t.data {
                TensorData::F32(v) => v.as_slice(),
                TensorData::I64(_) => unreachable!("dtypes checked above"),
            }),
        ),
        TensorData::I64(_) => HostTensor::i64(
            shape,
            concat(parts, |t| match &t.data {
                TensorData::I64(v) => v.as_slice(),
                TensorData::F32(_) => unreachable!("dtypes checked above"),
            }),
        ),
    })
}

fn concat<T: Copy>(parts: &[&HostTensor], data: impl Fn(&HostTensor) -> &[T]) -> Vec<T> {
    let mut out = Vec::with_capacity(parts.iter().map(|p| data(p).len()).sum());
    for p in parts {
        out.extend_from_slice(data(p));
    }
    out
}

/// Splits `t` along dimension 0 into parts of `rows[i]` rows each; `t` must
/// have exactly `rows.iter().sum()` rows.
pub(crate) fn split_rows(t: &HostTensor, rows: &[usize]) -> Result<Vec<HostTensor>, String> {
    let total: usize = rows.iter().sum();
    let Some((&have, trailing)) = t.shape.split_first() else {
        return Err(format!(
            "it is a scalar ({}), not one row per input row",
            t.describe()
        ));
    };
    if have != total {
        return Err(format!(
            "it has {have} rows ({}), the batch's inputs have {total}",
            t.describe()
        ));
    }
    let row_len: usize = trailing.iter().product();
    let part = |n: usize| {
        let mut shape = t.shape.clone();
        shape[0] = n;
        shape
    };
    let mut out = Vec::with_capacity(rows.len());
    let mut at = 0;
    for &n in rows {
        let range = at * row_len..(at + n) * row_len;
        out.push(match &t.data {
            TensorData::F32(v) => HostTensor::f32(part(n), v[range].to_vec()),
            TensorData::I64(v) => HostTensor::i64(part(n), v[range].to_vec()),
        });
        at += n;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_concatenate_and_split_back() {
        let a = HostTensor::f32(vec![1, 2], vec![1.0, 2.0]);
        let b = HostTensor::f32(vec![2, 2], vec![3.0, 4.0, 5.0, 6.0]);
        let c = concat_rows(&[&a, &b]).unwrap();
        assert_eq!(c.shape, vec![3, 2]);
        assert_eq!(c.data, TensorData::F32(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
        assert_eq!(split_rows(&c, &[1, 2]).unwrap(), vec![a, b]);
        let i = HostTensor::i64(vec![2], vec![7, 8]);
        let j = concat_rows(&[&i, &i]).unwrap();
        assert_eq!(j.data, TensorData::I64(vec![7, 8, 7, 8]));
        assert_eq!(split_rows(&j, &[2, 2]).unwrap(), vec![i.clone(), i]);
    }

    #[test]
    fn mismatches_name_the_input_and_the_shapes() {
        let a = HostTensor::f32(vec![1, 2], vec![1.0, 2.0]);
        let b = HostTensor::f32(vec![1, 3], vec![1.0, 2.0, 3.0]);
        let e = concat_rows(&[&a, &b]).unwrap_err();
        assert!(
            e.contains("batch input 1 is f32 [1, 3]") && e.contains("[1, 2]"),
            "{e}"
        );
        let i = HostTensor::i64(vec![1, 2], vec![1, 2]);
        assert!(concat_rows(&[&a, &i]).unwrap_err().contains("i64"));
        let scalar = HostTensor::f32(vec![], vec![1.0]);
        assert!(concat_rows(&[&scalar]).unwrap_err().contains("scalar"));
        let e = split_rows(&a, &[1, 1]).unwrap_err();
        assert!(e.contains("1 rows") && e.contains("have 2"), "{e}");
    }
}
