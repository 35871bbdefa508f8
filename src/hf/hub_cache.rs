//! Hugging Face Hub ids (`ORG/NAME`, `ORG/NAME@REV`) resolved to a snapshot directory of the
//! local Hugging Face cache, found and laid out exactly as `huggingface_hub` does
//! (`constants.py`, `file_download.py`); nothing is downloaded.
//!
//! ```text
//! <root>/models--ORG--NAME/refs/main              the commit `main` points at (40 hex)
//! <root>/models--ORG--NAME/snapshots/<commit>/... each file a link to ../../blobs/<hash>
//! <root>/models--ORG--NAME/blobs/<hash>           the contents
//! ```
//!
//! The root: `HF_HUB_CACHE`, else `HUGGINGFACE_HUB_CACHE` (legacy), else `$HF_HOME/hub`, else
//! `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub` (a leading `~` expanded).
//! A revision names `refs/<revision>` when that file exists (its commit, trimmed, names the
//! snapshot), else the snapshot folder itself (a commit hash). The environment is passed in
//! ([`Env`]) so that tests never touch the process's.

use std::fmt;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Result, bail};

/// Reads an environment variable: [`process_env`], or a test's map.
pub type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

/// The process's environment (unset and empty variables alike are `None`).
pub fn process_env(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.is_empty())
}

/// A model repository on the Hub and the revision asked for (`None`: `main`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubId {
    /// `ORG/NAME`.
    pub repo: String,
    /// A branch, tag or commit hash; `None` is `main`.
    pub revision: Option<String>,
}

impl HubId {
    /// `ORG/NAME` or `ORG/NAME@REV` as `huggingface_hub` accepts a namespaced repo id (exactly
    /// one `/`; ASCII letters, digits, `-`, `_`, `.`; neither part starting or ending with `-`
    /// or `.`; no `--` or `..`; at most 96 characters of name; not ending in `.git`), else
    /// `None`. Single-name ids (`gpt2`) are not taken: they read as relative paths.
    pub fn parse(s: &str) -> Option<HubId> {
        let (repo, revision) = match s.split_once('@') {
            Some((r, rev)) => (r, Some(rev.to_string())),
            None => (s, None),
        };
        let (org, name) = repo.split_once('/')?;
        let part_ok = |p: &str, max: usize| {
            let ok_char = |c: char| c.is_ascii_alphanumeric() || "-_.".contains(c);
            let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_');
            !p.is_empty()
                && p.len() <= max
                && p.chars().all(ok_char)
                && edge(p.chars().next())
                && edge(p.chars().last())
        };
        let valid = part_ok(org, usize::MAX)
            && part_ok(name, 96)
            && !repo.contains("--")
            && !repo.contains("..")
            && !repo.ends_with(".git");
        (valid && revision.as_deref().is_none_or(revision_ok))
            .then(|| HubId { repo: repo.to_string(), revision })
    }

    /// The revision looked up: the one given, or `main`.
    pub fn revision_or_main(&self) -> &str {
        self.revision.as_deref().unwrap_or("main")
    }

    /// The command that puts this repository (at its revision) into the cache.
    pub fn download_command(&self) -> String {
        match &self.revision {
            Some(r) => format!("hf download {} --revision {r}", self.repo),
            None => format!("hf download {}", self.repo),
        }
    }

    /// The repository's folder in the cache: `models--ORG--NAME`.
    pub fn folder(&self) -> String {
        format!("models--{}", self.repo.replace('/', "--"))
    }
}

impl fmt::Display for HubId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.revision {
            Some(r) => write!(f, "{}@{r}", self.repo),
            None => f.write_str(&self.repo),
        }
    }
}

/// A revision stays inside `refs/` and `snapshots/`: non-empty, relative, no `.` or `..`
/// component (`refs/pr/1` is a revision).
fn revision_ok(rev: &str) -> bool {
    !rev.is_empty()
        && !rev.starts_with('/')
        && rev.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
}

/// The cache root `huggingface_hub` uses in environment `env` (see the module comment).
pub fn cache_root(env: Env) -> PathBuf {
    let home = || env("HOME");
    let expand = |p: String| match (p.strip_prefix('~'), home()) {
        (Some(rest), Some(h)) if rest.is_empty() || rest.starts_with('/') => {
            PathBuf::from(format!("{h}{rest}"))
        }
        _ => PathBuf::from(p),
    };
    if let Some(p) = env("HF_HUB_CACHE").or_else(|| env("HUGGINGFACE_HUB_CACHE")) {
        return expand(p);
    }
    if let Some(p) = env("HF_HOME") {
        return expand(p).join("hub");
    }
    let cache = env("XDG_CACHE_HOME").unwrap_or_else(|| "~/.cache".to_string());
    expand(cache).join("huggingface").join("hub")
}

/// A Hub id found in the cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    pub id: HubId,
    /// The commit the revision names.
    pub commit: String,
    /// `<root>/models--ORG--NAME/snapshots/<commit>`.
    pub dir: PathBuf,
}

/// `id`'s snapshot in the cache at `root`, which must hold `needs` (`config.json`, say) and no
/// file whose blob is missing. `key` names the config key in errors (`model.path`).
pub fn find_snapshot(id: &HubId, root: &Path, key: &str, needs: &str) -> Result<Snapshot> {
    let repo_dir = root.join(id.folder());
    let get = id.download_command();
    if !repo_dir.is_dir() {
        bail!(
            "{key} {id}: not in the local Hugging Face cache ({})\nhint: run `{get}`, or set HF_HUB_CACHE / HF_HOME to the cache that holds it",
            root.display()
        );
    }
    let rev = id.revision_or_main();
    let ref_file = repo_dir.join("refs").join(rev);
    let commit = match fs::read_to_string(&ref_file) {
        Ok(text) => text.trim().to_string(),
        Err(_) => rev.to_string(),
    };
    let dir = repo_dir.join("snapshots").join(&commit);
    if commit.is_empty() || !revision_ok(&commit) || !dir.is_dir() {
        let named = if ref_file.is_file() {
            format!("refs/{rev} names commit {commit}, whose snapshot is missing")
        } else {
            format!("revision {rev} is neither a ref nor a snapshot")
        };
        bail!(
            "{key} {id}: {named} in the local Hugging Face cache ({}); refs: {}; snapshots: {}\nhint: run `{get}`, or set a revision that is there",
            repo_dir.display(),
            listing(&repo_dir.join("refs"), true),
            listing(&repo_dir.join("snapshots"), false),
        );
    }
    check_snapshot(id, &dir, key, needs)?;
    Ok(Snapshot { id: id.clone(), commit, dir })
}

/// A snapshot is whole: `needs` resolves to a file and no link dangles (an interrupted or
/// deleted download leaves links to absent blobs).
fn check_snapshot(id: &HubId, dir: &Path, key: &str, needs: &str) -> Result<()> {
    let mut dangling = Vec::new();
    dangling_links(dir, dir, &mut dangling);
    dangling.sort();
    let get = id.download_command();
    if !dangling.is_empty() {
        let shown: Vec<&str> = dangling.iter().take(3).map(String::as_str).collect();
        bail!(
            "{key} {id}: {} file(s) of snapshot {} have no blob ({}{}): an interrupted or removed download\nhint: run `{get}` again",
            dangling.len(),
            dir.display(),
            shown.join(", "),
            if dangling.len() > 3 { ", ..." } else { "" },
        );
    }
    if !dir.join(needs).is_file() {
        bail!(
            "{key} {id}: snapshot {} has no {needs}\nhint: run `{get}` (the whole repository, not a subset of its files)",
            dir.display()
        );
    }
    Ok(())
}

/// The links under `dir` (relative to `base`) whose targets do not exist.
fn dangling_links(base: &Path, dir: &Path, out: &mut Vec<String>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        let is_link = fs::symlink_metadata(&p).is_ok_and(|m| m.file_type().is_symlink());
        if is_link && fs::metadata(&p).is_err() {
            out.push(p.strip_prefix(base).unwrap_or(&p).display().to_string());
        } else if !is_link && p.is_dir() {
            dangling_links(base, &p, out);
        }
    }
}

/// The entries of `dir`, sorted and comma-separated (`refs`: files at any depth, as
/// `refs/pr/1`); `none` when empty or absent.
fn listing(dir: &Path, files_below: bool) -> String {
    fn walk(base: &Path, dir: &Path, deep: bool, out: &mut Vec<String>) {
        let Ok(entries) = fs::read_dir(dir) else { return };
        for e in entries.flatten() {
            let p = e.path();
            if deep && p.is_dir() {
                walk(base, &p, deep, out);
            } else {
                out.push(p.strip_prefix(base).unwrap_or(&p).display().to_string());
            }
        }
    }
    let mut names = Vec::new();
    walk(dir, dir, files_below, &mut names);
    names.sort();
    if names.is_empty() { "none".to_string() } else { names.join(", ") }
}

/// The Hub repo (`ORG/NAME`) and commit of a snapshot directory of a Hugging Face cache,
/// `.../models--ORG--NAME/snapshots/<commit>`; `None` for any other path. (`--` never occurs in
/// a repo id, so the folder's name gives the id back.)
pub fn id_of_snapshot_dir(dir: &Path) -> Option<(String, String)> {
    let name = |p: &Path| p.file_name()?.to_str().map(str::to_string);
    let commit = name(dir)?;
    let snapshots = dir.parent()?;
    if name(snapshots)? != "snapshots" {
        return None;
    }
    let folder = name(snapshots.parent()?)?;
    let (org, repo) = folder.strip_prefix("models--")?.split_once("--")?;
    let id = HubId::parse(&format!("{org}/{repo}"))?;
    Some((id.repo, commit))
}

/// What a config value names: a local path (returned as is), or a Hub id resolved in the cache
/// of `env`. A value is a Hub id when no file or directory of that name exists and it parses as
/// one ([`HubId::parse`]); `revision` (a config key such as `model.revision`) applies to it, and
/// may not be given both ways. `None` when `value` is a path.
pub fn resolve_value(
    key: &str,
    value: &str,
    revision: Option<&str>,
    needs: &str,
    env: Env,
) -> Result<Option<Snapshot>> {
    if Path::new(value).exists() {
        return Ok(None);
    }
    let Some(mut id) = HubId::parse(value) else { return Ok(None) };
    if let Some(r) = revision {
        if let Some(at) = &id.revision {
            bail!(
                "{key} {value}: the revision is given twice (@{at} and {r})\nhint: keep one of them"
            );
        }
        if !revision_ok(r) {
            bail!("{key} {value}: revision '{r}' is not a branch, tag or commit name");
        }
        id.revision = Some(r.to_string());
    }
    find_snapshot(&id, &cache_root(env), key, needs).map(Some)
}

/// A command-line path (`--model`, `--base`, `--adapter`): itself, or, when it names no file
/// and parses as a Hub id, its snapshot in the local cache of the process's environment.
pub fn local_path(key: &str, value: &Path, needs: &str) -> Result<PathBuf> {
    let Some(text) = value.to_str() else { return Ok(value.to_path_buf()) };
    Ok(match resolve_value(key, text, None, needs, &process_env)? {
        Some(s) => s.dir,
        None => value.to_path_buf(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> =
            pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k: &str| m.get(k).cloned()
    }

    #[test]
    fn hub_ids_parse_as_huggingface_hub_validates_them() {
        let id = HubId::parse("Qwen/Qwen3-0.6B").unwrap();
        assert_eq!((id.repo.as_str(), id.revision.as_deref()), ("Qwen/Qwen3-0.6B", None));
        assert_eq!(id.folder(), "models--Qwen--Qwen3-0.6B");
        assert_eq!(id.download_command(), "hf download Qwen/Qwen3-0.6B");
        let id = HubId::parse("meta-llama/Llama-3.1-8B@refs/pr/1").unwrap();
        assert_eq!(id.revision.as_deref(), Some("refs/pr/1"));
        assert_eq!(id.to_string(), "meta-llama/Llama-3.1-8B@refs/pr/1");
        assert_eq!(
            id.download_command(),
            "hf download meta-llama/Llama-3.1-8B --revision refs/pr/1"
        );
        for bad in [
            "gpt2",
            "a/b/c",
            "./m",
            "/abs/m",
            "~/m",
            "../m",
            "org/-name",
            "org/name.",
            "org/na--me",
            "org/na..me",
            "org/name.git",
            "org/ name",
            "org/café",
            "org/",
            "org/name@",
            "org/name@../x",
        ] {
            assert_eq!(HubId::parse(bad), None, "{bad}");
        }
        assert!(HubId::parse(&format!("o/{}", "n".repeat(96))).is_some());
        assert!(HubId::parse(&format!("o/{}", "n".repeat(97))).is_none());
    }

    #[test]
    fn snapshot_dirs_give_their_hub_id_back() {
        let d = Path::new("/c/hub/models--Qwen--Qwen3-0.6B/snapshots/abc123");
        assert_eq!(id_of_snapshot_dir(d), Some(("Qwen/Qwen3-0.6B".into(), "abc123".into())));
        for other in ["/c/hub/models--Qwen--Qwen3-0.6B/blobs/abc", "/m/Qwen3-0.6B", "/", "abc"] {
            assert_eq!(id_of_snapshot_dir(Path::new(other)), None, "{other}");
        }
    }

    #[test]
    fn cache_root_follows_huggingface_hub_precedence() {
        let root = |pairs: &[(&str, &str)]| cache_root(&env_of(pairs));
        let all = [
            ("HOME", "/h"),
            ("XDG_CACHE_HOME", "/x"),
            ("HF_HOME", "/hf"),
            ("HUGGINGFACE_HUB_CACHE", "/legacy"),
            ("HF_HUB_CACHE", "/c"),
        ];
        assert_eq!(root(&all), Path::new("/c"));
        assert_eq!(root(&all[..4]), Path::new("/legacy"));
        assert_eq!(root(&all[..3]), Path::new("/hf/hub"));
        assert_eq!(root(&all[..2]), Path::new("/x/huggingface/hub"));
        assert_eq!(root(&all[..1]), Path::new("/h/.cache/huggingface/hub"));
        assert_eq!(root(&[("HOME", "/h"), ("HF_HOME", "~/hf")]), Path::new("/h/hf/hub"));
        assert_eq!(root(&[("HOME", "/h"), ("HF_HUB_CACHE", "~")]), Path::new("/h"));
    }
}
