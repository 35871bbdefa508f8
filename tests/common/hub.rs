//! A fake Hugging Face cache, laid out exactly as `huggingface_hub` lays one out: each file's
//! contents in `blobs/<hash>`, each snapshot file a relative link to its blob, and each ref a
//! file holding the commit it points at.

use std::fs;
use std::path::{Path, PathBuf};

/// A commit hash of the fake cache (40 hex digits), distinct per `n`.
pub fn commit(n: u8) -> String {
    format!("{n:02x}").repeat(20)
}

/// A content hash for a blob's name (FNV-1a, 64 bits, as hex; the real cache uses the file's
/// git or sha256 hash: only uniqueness matters here).
fn blob_name(bytes: &[u8]) -> String {
    let h = bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3));
    format!("{h:016x}")
}

/// Add snapshot `commit` of model repo `repo` (`ORG/NAME`) to the cache at `root`, holding
/// `files` (name, contents; a name may have folders), and point each of `refs` at it. Returns
/// the snapshot directory.
pub fn add_snapshot(
    root: &Path,
    repo: &str,
    commit: &str,
    files: &[(&str, Vec<u8>)],
    refs: &[&str],
) -> PathBuf {
    let repo_dir = root.join(format!("models--{}", repo.replace('/', "--")));
    let snap = repo_dir.join("snapshots").join(commit);
    fs::create_dir_all(repo_dir.join("blobs")).unwrap();
    for (name, bytes) in files {
        let blob = blob_name(bytes);
        fs::write(repo_dir.join("blobs").join(&blob), bytes).unwrap();
        let link = snap.join(name);
        fs::create_dir_all(link.parent().unwrap()).unwrap();
        let up = "../".repeat(name.matches('/').count() + 2);
        let _ = fs::remove_file(&link); // the same snapshot added again
        std::os::unix::fs::symlink(format!("{up}blobs/{blob}"), &link).unwrap();
    }
    fs::create_dir_all(&snap).unwrap();
    for r in refs {
        let f = repo_dir.join("refs").join(r);
        fs::create_dir_all(f.parent().unwrap()).unwrap();
        fs::write(f, commit).unwrap();
    }
    snap
}

/// The files of directory `dir` (not below), read, to put in a snapshot.
pub fn files_of(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .map(|p| (p.file_name().unwrap().to_str().unwrap().to_string(), fs::read(&p).unwrap()))
        .collect();
    out.sort();
    out
}

/// `files_of` borrowed as `add_snapshot` takes them.
pub fn as_refs(files: &[(String, Vec<u8>)]) -> Vec<(&str, Vec<u8>)> {
    files.iter().map(|(n, b)| (n.as_str(), b.clone())).collect()
}
