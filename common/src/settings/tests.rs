//! Loading whole settings directories: the shipped one and broken copies.

use super::*;

fn shipped_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../settings")
}

/// A copy of the shipped directory in a temp dir, as `<tmp>/settings`.
fn copy_of_shipped() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("settings");
    std::fs::create_dir(&dir).unwrap();
    for entry in std::fs::read_dir(shipped_dir()).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
        }
    }
    (tmp, dir)
}

#[test]
fn shipped_settings_parse() {
    let s = Settings::load(&shipped_dir()).unwrap();
    assert_eq!(s.config.mode, Mode::Local);
    assert_eq!(s.config.world_size, 1);
    assert_eq!(s.config.gpu_list, vec![0]);
    assert_eq!(s.config.num_models, 20);
    assert_eq!(s.config.unknown_keys().count(), 0);
    assert_eq!(*s.metadata_endpoint(), Endpoint::new("127.0.0.1", 7777));
    assert_eq!(
        s.memservers(),
        &[
            Endpoint::new("127.0.0.1", 7778),
            Endpoint::new("127.0.0.1", 7779)
        ]
    );
    assert_eq!(
        s.gpu_hosts,
        vec![GpuHost {
            host: "127.0.0.1".into(),
            slots: 1
        }]
    );
    assert_eq!(s.username.as_deref(), Some("ubuntu"));
    assert_eq!(s.require_username().unwrap(), "ubuntu");
    assert!(s.cluster_key.as_bytes().len() >= CLUSTER_KEY_CHARS_MIN);
    assert_eq!(s.shard_width(), 2);
    assert!(s.mps_controller.is_some());
    assert_eq!(s.controller.metadata_endpoint(), *s.metadata_endpoint());

    let models = s.model_list().unwrap();
    assert_eq!(models.names.len(), 20);
    assert_eq!(models.names[0], "resnet152-tiny-00000000");
    assert_eq!(models.names[19], "gpt2-tiny-00000019");
    let families = [
        "resnet152",
        "inception_v3",
        "densenet201",
        "bert_base",
        "gpt2",
    ];
    for (i, name) in models.names.iter().enumerate() {
        assert_eq!(*name, format!("{}-tiny-{i:08}", families[i % 5]));
    }
    let weights = s.family_weights.as_ref().unwrap();
    for f in families {
        assert!(weights.get(f).unwrap() > 0.0, "{f}");
    }

    let ray = s.ray_controller.as_ref().unwrap();
    let servers = load_ray_server_list(&s.resolve_path(&ray.server_list_file)).unwrap();
    assert_eq!(
        servers,
        vec![RayServer {
            host: "127.0.0.1".into(),
            gpu: 0
        }]
    );
}

#[test]
fn relative_paths_resolve_against_the_parent_of_the_settings_dir() {
    let (tmp, dir) = copy_of_shipped();
    let s = Settings::load(&dir).unwrap();
    let root = tmp.path().canonicalize().unwrap();
    assert_eq!(s.root(), root);
    assert_eq!(
        s.resolve_path("settings/model_list.txt"),
        root.join("settings/model_list.txt")
    );
    assert_eq!(s.resolve_path("/abs/x"), Path::new("/abs/x"));
    assert_eq!(s.model_list().unwrap().names.len(), 20);
}

#[test]
fn required_and_optional_files() {
    for required in [
        files::CONFIG_SH,
        files::STORAGE_LIST,
        files::CONTROLLER,
        files::CLUSTER_KEY,
    ] {
        let (_tmp, dir) = copy_of_shipped();
        std::fs::remove_file(dir.join(required)).unwrap();
        let e = Settings::load(&dir).unwrap_err();
        assert!(
            matches!(e, SettingsError::Missing { .. }),
            "{required}: {e}"
        );
        assert_eq!(e.path(), dir.join(required));
    }
    let (_tmp, dir) = copy_of_shipped();
    for optional in [
        files::SERVERHOST_LIST,
        files::USERNAME,
        files::MPS_CONTROLLER,
        files::RAY_CONTROLLER,
        files::FAMILY_WEIGHTS,
    ] {
        std::fs::remove_file(dir.join(optional)).unwrap();
    }
    let s = Settings::load(&dir).unwrap();
    assert!(s.gpu_hosts.is_empty() && s.username.is_none() && s.mps_controller.is_none());
    assert!(s.ray_controller.is_none() && s.family_weights.is_none());
    let e = s.require_username().unwrap_err().to_string();
    assert!(
        e.contains("username.txt: required settings file is missing"),
        "{e}"
    );
}

#[test]
fn errors_in_any_file_name_that_file() {
    let (_tmp, dir) = copy_of_shipped();
    std::fs::write(dir.join(files::USERNAME), "a\nb\n").unwrap();
    let e = Settings::load(&dir).unwrap_err();
    assert_eq!(
        (e.path(), e.line_number()),
        (dir.join(files::USERNAME).as_path(), Some(2))
    );

    let (_tmp, dir) = copy_of_shipped();
    std::fs::write(dir.join(files::CONFIG_SH), "MODE=$(echo remote)\n").unwrap();
    let e = Settings::load(&dir).unwrap_err().to_string();
    assert!(
        e.contains("config.sh:1: expected KEY=VALUE") && e.contains("never executed"),
        "{e}"
    );
}

#[test]
fn sharding_options_must_fit_the_memory_servers() {
    let (_tmp, dir) = copy_of_shipped();
    let path = dir.join(files::CONTROLLER);
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(
        &path,
        text.replace(
            "\"num_servers\": 0,",
            "\"num_servers\": 0, \"shard_width\": 3,",
        ),
    )
    .unwrap();
    let e = Settings::load(&dir).unwrap_err().to_string();
    assert!(
        e.contains("controller.json: field \"shard_width\": 3 is more than the 2 memory servers"),
        "{e}"
    );

    std::fs::write(
        &path,
        text.replace(
            "\"num_servers\": 0,",
            "\"num_servers\": 0, \"replication\": 3,",
        ),
    )
    .unwrap();
    let e = Settings::load(&dir).unwrap_err().to_string();
    assert!(e.contains("field \"replication\": 3 copies"), "{e}");

    std::fs::write(
        &path,
        text.replace(
            "\"num_servers\": 0,",
            "\"num_servers\": 0, \"replication\": 2, \"shard_width\": 2,",
        ),
    )
    .unwrap();
    assert_eq!(Settings::load(&dir).unwrap().shard_width(), 2);
}

#[test]
fn settings_file_size_is_bounded() {
    let (_tmp, dir) = copy_of_shipped();
    let f = std::fs::File::create(dir.join(files::STORAGE_LIST)).unwrap();
    f.set_len(SETTINGS_FILE_BYTES_MAX + 1).unwrap();
    let e = Settings::load(&dir).unwrap_err().to_string();
    assert!(e.contains("more than the 16777216 allowed"), "{e}");
}

#[test]
fn junk_never_panics() {
    let junk = [
        "",
        "\"",
        "'",
        "{",
        "[",
        "\\",
        "$",
        "${",
        "$(",
        "\"\\é\"",
        "é=1",
        "{\"a\\é\": 1}",
        "{\"slo_ms\": {\"é\": \"x\"}}",
        "storage_address, storage_port\né, 1",
        "model_name\n\u{0}",
        "model_name, weight\n,,",
        "::::",
        "[::1",
        "a=\"$",
        "x=${é}",
        "\"é slots=1\"",
        "1:",
        ":1",
        "{\"use_train\": \"é\"}",
    ];
    let p = Path::new("f");
    for j in junk {
        let _ = ConfigSh::parse(p, j);
        let _ = StorageList::parse(p, j);
        let _ = parse_serverhost_list(p, j);
        let _ = ControllerSettings::parse(p, j);
        let _ = RayControllerSettings::parse(p, j);
        let _ = parse_username(p, j);
        let _ = ModelList::parse(p, j);
        let _ = FamilyWeights::parse(p, j);
        let _ = parse_ray_server_list(p, j);
        let _ = ClusterKey::parse(p, j);
    }
}
