//! The `settings/` directory: the original DistMind's files, parsed as they
//! are (header lines, irregular spacing, `//` and `#` comments), never
//! executed.
//!
//! | file | required | parser |
//! |---|---|---|
//! | `config.sh` | yes | [`ConfigSh`] |
//! | `storage_list.txt` | yes | [`StorageList`] (first data line = metadata endpoint) |
//! | `controller.json` | yes | [`ControllerSettings`] |
//! | `cluster.key` | yes | [`ClusterKey`] |
//! | `serverhost_list.txt` | no | [`GpuHost`] list |
//! | `username.txt` | no | ssh user |
//! | `mps_controller.json` | no | [`ControllerSettings`] |
//! | `ray_controller.json` | no | [`RayControllerSettings`] |
//! | `family_weights.txt` | no | [`FamilyWeights`] |
//! | `transport.json` | no | [`TransportSettings`] (data paths; default tcp) |
//!
//! Every error is a [`SettingsError`] naming the file, the 1-based line (and
//! column for JSON) and what was expected versus found.
//!
//! Relative paths inside settings files (e.g. `model_list_filename`) are
//! resolved against the parent of the settings directory, i.e. the
//! repository root: the original's scripts ran from the repository root with
//! `settings/` in it, so the same files mean the same paths here, whatever
//! the current directory of the process is. See [`Settings::resolve_path`].

mod cluster_key;
mod config_sh;
mod controller_json;
mod endpoint;
mod error;
mod serverhost_list;
mod simple_lists;
mod storage_list;
mod transport_json;

use std::path::{Path, PathBuf};

pub use cluster_key::{ClusterKey, CLUSTER_KEY_BYTES_MAX, CLUSTER_KEY_CHARS_MIN, CLUSTER_KEY_HINT};
pub use config_sh::{ConfigSh, ConfigValue, Mode, GPUS_PER_HOST_MAX, KNOWN_KEYS};
pub use controller_json::{
    ControllerSettings, RayControllerSettings, ShardStrategy, GROUP_BYTES_MAX, POLICY_DEFAULT,
    RESCHEDULING_PERIOD_S_DEFAULT, SHARD_WIDTH_AUTO_MAX, ZIPF_S_DEFAULT,
};
pub use endpoint::Endpoint;
pub use error::{SettingsError, SETTINGS_FILE_BYTES_MAX};
pub use serverhost_list::{load_serverhost_list, parse_serverhost_list, GpuHost};
pub use simple_lists::{
    load_ray_server_list, load_username, parse_ray_server_list, parse_username, FamilyWeights,
    ModelList, RayServer,
};
pub use storage_list::{StorageList, MEMSERVERS_MAX};
pub use transport_json::{
    check_fabric_provider, EmulateSection, GpuServerTransport, MemserverTransport, TransportKind,
    TransportSettings, FABRIC_PROVIDERS, FABRIC_PROVIDER_DEFAULT,
};

/// File names inside the settings directory.
pub mod files {
    pub const CONFIG_SH: &str = "config.sh";
    pub const STORAGE_LIST: &str = "storage_list.txt";
    pub const SERVERHOST_LIST: &str = "serverhost_list.txt";
    pub const CONTROLLER: &str = "controller.json";
    pub const MPS_CONTROLLER: &str = "mps_controller.json";
    pub const RAY_CONTROLLER: &str = "ray_controller.json";
    pub const USERNAME: &str = "username.txt";
    pub const CLUSTER_KEY: &str = "cluster.key";
    pub const FAMILY_WEIGHTS: &str = "family_weights.txt";
    pub const TRANSPORT: &str = "transport.json";
}

/// The whole settings directory, loaded and cross-checked.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The directory as given to [`Settings::load`].
    pub dir: PathBuf,
    /// Base for relative paths in settings files: the parent of `dir`.
    root: PathBuf,
    pub config: ConfigSh,
    pub storage: StorageList,
    /// GPU servers of `serverhost_list.txt`; empty when the file is absent.
    pub gpu_hosts: Vec<GpuHost>,
    pub controller: ControllerSettings,
    pub mps_controller: Option<ControllerSettings>,
    pub ray_controller: Option<RayControllerSettings>,
    /// The ssh user of `username.txt`, when present.
    pub username: Option<String>,
    pub cluster_key: ClusterKey,
    pub family_weights: Option<FamilyWeights>,
    /// `transport.json`; defaults (tcp everywhere) when absent.
    pub transport: TransportSettings,
}

impl Settings {
    /// Loads every file of `dir`: required ones must exist, optional ones
    /// are parsed when present. Nothing is executed and no network is used.
    pub fn load(dir: &Path) -> Result<Settings, SettingsError> {
        let config = ConfigSh::load(&dir.join(files::CONFIG_SH))?;
        let storage = StorageList::load(&dir.join(files::STORAGE_LIST))?;
        let controller_path = dir.join(files::CONTROLLER);
        let controller = ControllerSettings::load(&controller_path)?;
        let cluster_key = ClusterKey::load(&dir.join(files::CLUSTER_KEY))?;
        let gpu_hosts =
            load_serverhost_list(&dir.join(files::SERVERHOST_LIST))?.unwrap_or_default();
        let mps_path = dir.join(files::MPS_CONTROLLER);
        let mps_controller = ControllerSettings::load_optional(&mps_path)?;
        let ray_controller =
            RayControllerSettings::load_optional(&dir.join(files::RAY_CONTROLLER))?;
        let username = load_username(&dir.join(files::USERNAME))?;
        let family_weights = FamilyWeights::load_optional(&dir.join(files::FAMILY_WEIGHTS))?;
        let transport =
            TransportSettings::load_optional(&dir.join(files::TRANSPORT))?.unwrap_or_default();

        let memservers = storage.memservers.len();
        for key in transport.memserver_overrides.keys() {
            if !storage.memservers.iter().any(|m| m.to_string() == *key) {
                return Err(SettingsError::file(
                    &dir.join(files::TRANSPORT),
                    format!(
                        "field \"memserver_overrides\": {key:?} is not a memory server of {}",
                        storage.path.display()
                    ),
                ));
            }
        }
        for (path, c) in std::iter::once((&controller_path, &controller))
            .chain(mps_controller.as_ref().map(|c| (&mps_path, c)))
        {
            check_against_storage(path, c, &storage)?;
        }

        let root = dir
            .canonicalize()
            .ok()
            .and_then(|d| d.parent().map(Path::to_path_buf))
            .or_else(|| dir.parent().map(Path::to_path_buf))
            .unwrap_or_default();
        log::debug!(
            "loaded settings from {}: metadata {}, {memservers} memory servers, {} GPU hosts",
            dir.display(),
            storage.metadata,
            gpu_hosts.len()
        );
        Ok(Settings {
            dir: dir.to_path_buf(),
            root,
            config,
            storage,
            gpu_hosts,
            controller,
            mps_controller,
            ray_controller,
            username,
            cluster_key,
            family_weights,
            transport,
        })
    }

    /// The first data line of `storage_list.txt`: the metadata (catalog)
    /// endpoint.
    pub fn metadata_endpoint(&self) -> &Endpoint {
        &self.storage.metadata
    }

    /// The memory servers: the lines of `storage_list.txt` after the first.
    pub fn memservers(&self) -> &[Endpoint] {
        &self.storage.memservers
    }

    /// Memory servers each model is sharded over.
    pub fn shard_width(&self) -> usize {
        self.controller
            .effective_shard_width(self.storage.memservers.len())
    }

    /// The directory relative paths in settings files are resolved against
    /// (the parent of the settings directory, canonicalized).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Resolves a path written in a settings file: absolute paths are kept,
    /// relative ones are joined to [`Settings::root`] (the repository root
    /// when `dir` is `<repo>/settings`), as the original's scripts, run from
    /// the repository root, saw them.
    pub fn resolve_path(&self, path: impl AsRef<Path>) -> PathBuf {
        let path = path.as_ref();
        if path.is_absolute() {
            path.to_path_buf()
        } else {
            self.root.join(path)
        }
    }

    /// Loads the controller's `model_list_filename`.
    pub fn model_list(&self) -> Result<ModelList, SettingsError> {
        ModelList::load(&self.resolve_path(&self.controller.model_list_filename))
    }

    /// The ssh user, required in remote mode.
    pub fn require_username(&self) -> Result<&str, SettingsError> {
        self.username
            .as_deref()
            .ok_or_else(|| SettingsError::Missing {
                path: self.dir.join(files::USERNAME),
                hint: "remote mode needs it: write the ssh user on one line".into(),
            })
    }
}

/// Sharding options must fit the memory servers of the storage list; a
/// metadata endpoint that disagrees with the storage list is only warned
/// about (the storage list is authoritative).
fn check_against_storage(
    path: &Path,
    c: &ControllerSettings,
    storage: &StorageList,
) -> Result<(), SettingsError> {
    let n = storage.memservers.len();
    let sp = storage.path.display();
    if c.shard_width as usize > n {
        return Err(SettingsError::file(
            path,
            format!(
                "field \"shard_width\": {} is more than the {n} memory servers of {sp}; use at most {n}, or 0 for min(#memory servers, {SHARD_WIDTH_AUTO_MAX})",
                c.shard_width
            ),
        ));
    }
    if c.replication as usize > n {
        return Err(SettingsError::file(
            path,
            format!(
                "field \"replication\": {} copies need as many distinct memory servers, but {sp} lists {n}",
                c.replication
            ),
        ));
    }
    let named = c.metadata_endpoint();
    if named != storage.metadata {
        log::warn!(
            "{}: metadata_addr/metadata_port {named} differ from the first line of {sp} ({}); using {}",
            path.display(),
            storage.metadata,
            storage.metadata
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests;
