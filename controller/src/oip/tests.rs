use super::*;

#[test]
fn datatypes_round_trip_their_protocol_names() {
    for d in Datatype::ALL {
        assert_eq!(Datatype::parse(d.as_str()).unwrap(), d);
    }
    assert_eq!(Datatype::F32.element_bytes(), Some(4));
    assert_eq!(Datatype::Bytes.element_bytes(), None);
    let e = Datatype::parse("FLOAT32").unwrap_err();
    assert_eq!(e.http_status(), 400);
    assert!(
        e.message.contains("\"FLOAT32\"") && e.message.contains("FP32"),
        "{e}"
    );
}

#[test]
fn every_error_code_maps_to_a_status_and_keeps_its_name() {
    use ErrorCode::*;
    let cases = [
        (BadRequest, 400, grpc_code::INVALID_ARGUMENT),
        (UnknownModel, 404, grpc_code::NOT_FOUND),
        (UnknownExtent, 500, grpc_code::INTERNAL),
        (Full, 429, grpc_code::RESOURCE_EXHAUSTED),
        (ChecksumMismatch, 500, grpc_code::INTERNAL),
        (Busy, 503, grpc_code::UNAVAILABLE),
        (DeadlineExceeded, 504, grpc_code::DEADLINE_EXCEEDED),
        (Rejected, 429, grpc_code::RESOURCE_EXHAUSTED),
        (ShuttingDown, 503, grpc_code::UNAVAILABLE),
        (Unavailable, 503, grpc_code::UNAVAILABLE),
        (Unsupported, 501, grpc_code::UNIMPLEMENTED),
        (Internal, 500, grpc_code::INTERNAL),
    ];
    for (code, http, grpc) in cases {
        let e = OipError::from(ErrorReply::new(code, "what went wrong"));
        assert_eq!(e.http_status(), http, "{code:?}");
        assert_eq!(e.grpc_code(), grpc, "{code:?}");
        assert_eq!(e.message, format!("{}: what went wrong", code.as_str()));
    }
    let e = OipError::too_large("request body", Some(70 << 20), Frontend::BODY_BYTES_MAX);
    assert_eq!(
        (e.http_status(), e.grpc_code()),
        (413, grpc_code::RESOURCE_EXHAUSTED)
    );
    assert!(
        e.message.contains(&Frontend::BODY_BYTES_MAX.to_string()),
        "{e}"
    );
    let e = OipError::unauthenticated("no key");
    assert_eq!(
        (e.http_status(), e.grpc_code()),
        (401, grpc_code::UNAUTHENTICATED)
    );
}

#[test]
fn tensor_sizes_are_checked() {
    let t = |datatype, shape: Vec<i64>, data: Vec<u8>| Tensor {
        name: "x".into(),
        datatype,
        shape,
        data,
    };
    assert!(t(Datatype::F32, vec![2, 3], vec![0; 24])
        .check_size()
        .is_ok());
    let e = t(Datatype::F32, vec![2, 3], vec![0; 20])
        .check_size()
        .unwrap_err();
    assert!(e.message.contains("24 bytes, got 20"), "{e}");
    let e = t(Datatype::F32, vec![-1, 3], vec![])
        .check_size()
        .unwrap_err();
    assert!(e.message.contains("negative"), "{e}");
    let e = t(Datatype::U8, vec![i64::MAX, i64::MAX], vec![])
        .check_size()
        .unwrap_err();
    assert!(e.message.contains("overflows"), "{e}");
    let mut bytes = Vec::new();
    for s in ["ab", ""] {
        bytes.extend((s.len() as u32).to_le_bytes());
        bytes.extend(s.as_bytes());
    }
    assert!(t(Datatype::Bytes, vec![2], bytes.clone())
        .check_size()
        .is_ok());
    let e = t(Datatype::Bytes, vec![3], bytes.clone())
        .check_size()
        .unwrap_err();
    assert!(e.message.contains("element 2 of 3"), "{e}");
    bytes.push(0);
    assert!(t(Datatype::Bytes, vec![2], bytes).check_size().is_err());
}

#[test]
fn npy_frames_round_trip() {
    let data: Vec<u8> = (0..24u8).collect();
    let f = npy::encode(Datatype::F32, &[2, 3], &data);
    assert_eq!(f.len() % 64, data.len() % 64, "header padded to 64 bytes");
    assert_eq!(
        npy::decode(&f).unwrap(),
        (Datatype::F32, vec![2, 3], data.clone())
    );
    let f = npy::encode(Datatype::I64, &[3], &data);
    assert_eq!(
        npy::decode(&f).unwrap(),
        (Datatype::I64, vec![3], data.clone())
    );
    let mut cut = npy::encode(Datatype::F32, &[2, 3], &data);
    cut.pop();
    assert!(npy::decode(&cut)
        .unwrap_err()
        .contains("needs Some(24) bytes"));
    assert!(npy::decode(b"not npy at all").is_err());
}

fn manifest() -> serde_json::Value {
    serde_json::json!({
        "inputs": [{"name": "input_ids", "shape": [1, 16], "dtype": "I64"}],
        "outputs": [
            {"name": "last_hidden_state", "layer": 3, "shape": [1, 16, 8], "dtype": "F32"},
            {"name": "pooler_output", "layer": 5, "shape": [1, 8], "dtype": "F32"}
        ],
        "layers": []
    })
}

#[test]
fn signatures_free_the_batch_and_check_inputs() {
    let s = Signature::of("bert", "3".into(), &manifest()).unwrap();
    assert_eq!(s.inputs[0].shape, vec![-1, 16]);
    assert_eq!(s.outputs[1].shape, vec![-1, 8]);
    let ids = |shape: Vec<i64>, datatype| {
        let n: i64 = shape.iter().product();
        Tensor {
            name: "input_ids".into(),
            datatype,
            shape,
            data: vec![0; n.max(0) as usize * 8],
        }
    };
    let frame = s.input_frame(&[ids(vec![4, 16], Datatype::I64)]).unwrap();
    assert_eq!(
        npy::decode(&frame).unwrap().1,
        vec![4, 16],
        "any batch is sent on"
    );
    let e = s
        .input_frame(&[ids(vec![1, 17], Datatype::I64)])
        .unwrap_err();
    assert_eq!(e.http_status(), 400);
    assert!(
        e.message.contains("[1, 17]") && e.message.contains("[-1, 16]"),
        "{e}"
    );
    let e = s
        .input_frame(&[ids(vec![0, 16], Datatype::I64)])
        .unwrap_err();
    assert!(e.message.contains("(batch) is 0"), "{e}");
    let e = s
        .input_frame(&[ids(vec![1, 16], Datatype::F32)])
        .unwrap_err();
    assert!(e.message.contains("datatype FP32, expected INT64"), "{e}");
    let mut other = ids(vec![1, 16], Datatype::I64);
    other.name = "tokens".into();
    let e = s.input_frame(&[other]).unwrap_err();
    assert!(e.message.contains("no input \"tokens\""), "{e}");
    assert!(s.input_frame(&[]).is_err());
    // A batch whose frame is over the GPU servers' frame bound.
    let rows = CONTROL_FRAME_BYTES_MAX as i64 / (16 * 8) + 1;
    let e = s
        .input_frame(&[ids(vec![rows, 16], Datatype::I64)])
        .unwrap_err();
    assert_eq!(e.http_status(), 413);
    assert!(
        e.message.contains("smaller batch") && e.message.contains("16 MiB"),
        "{e}"
    );
    assert_eq!(
        s.requested_outputs(None).unwrap(),
        vec!["last_hidden_state", "pooler_output"]
    );
    assert_eq!(
        s.requested_outputs(Some(&["pooler_output".into()]))
            .unwrap(),
        vec!["pooler_output"]
    );
    let e = s.requested_outputs(Some(&["logits".into()])).unwrap_err();
    assert!(
        e.message.contains("\"logits\"") && e.message.contains("pooler_output"),
        "{e}"
    );
}

#[test]
fn a_transformer_takes_any_length_up_to_its_position_table() {
    let mut m = manifest();
    m["inputs"][0]["variable"] = serde_json::json!([
        {"dim": 0, "kind": "batch"},
        {"dim": 1, "kind": "sequence", "max": 64}
    ]);
    let s = Signature::of("bert", "3".into(), &m).unwrap();
    assert_eq!(s.inputs[0].shape, vec![-1, -1]);
    let ids = |shape: Vec<i64>| {
        let n: i64 = shape.iter().product();
        Tensor {
            name: "input_ids".into(),
            datatype: Datatype::I64,
            shape,
            data: vec![0; n as usize * 8],
        }
    };
    for len in [1, 16, 64] {
        let frame = s.input_frame(&[ids(vec![2, len])]).unwrap();
        assert_eq!(npy::decode(&frame).unwrap().1, vec![2, len]);
    }
    let e = s.input_frame(&[ids(vec![1, 65])]).unwrap_err();
    assert_eq!(e.http_status(), 400);
    assert!(
        e.message.contains("[1, 65]") && e.message.contains("tokens 1..=64"),
        "{e}"
    );
}

#[test]
fn constant_time_comparison() {
    assert!(constant_time_eq(b"abc", b"abc"));
    assert!(!constant_time_eq(b"abc", b"abd"));
    assert!(!constant_time_eq(b"abc", b"abcd"));
}
