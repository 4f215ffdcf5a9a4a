//! A check of the crate's layout (a test only): the `use crate::...` paths
//! of every source file make a graph of modules, which must have no cycle,
//! and in which nothing in `cell/` reaches `parent/`, nor the reverse.
//!
//! `cargo test -p densevm module_graph -- --nocapture` prints the graph
//! between the top-level folders.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's path from the crate root (`["cell", "proxy"]`).
type ModPath = Vec<String>;

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("source folder") {
        let path = entry.expect("source entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module a file defines: `cell/mod.rs` is `cell`, `main.rs` the root.
fn module_of(src: &Path, file: &Path) -> ModPath {
    let relative = file.strip_prefix(src).expect("under src");
    let mut parts: ModPath = relative
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if matches!(parts.last().map(String::as_str), Some("mod" | "main")) {
        parts.pop();
    }
    parts
}

/// The `crate::` paths a file names outside comments, each as its segments
/// (a group, `crate::a::{b, c::d}`, gives `a::b` and `a::c::d`).
fn crate_paths(text: &str) -> Vec<ModPath> {
    let mut paths = Vec::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or("");
        let mut rest = code;
        while let Some(at) = rest.find("crate::") {
            rest = &rest[at + "crate::".len()..];
            let end = rest
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(rest.len());
            let prefix = segments(&rest[..end]);
            match rest[end..].strip_prefix('{') {
                Some(group) => {
                    let close = group.find('}').unwrap_or(group.len());
                    for item in group[..close].split(',') {
                        let mut path = prefix.clone();
                        path.extend(segments(item.trim()));
                        paths.push(path);
                    }
                }
                None => paths.push(prefix),
            }
        }
    }
    paths
}

/// The segments of `a::b::c`, without `self`.
fn segments(text: &str) -> ModPath {
    text.split("::")
        .map(|s| s.split_whitespace().next().unwrap_or(""))
        .filter(|s| !s.is_empty() && *s != "self")
        .map(str::to_string)
        .collect()
}

/// The edges between modules: a file's module uses the longest known
/// module prefix of each path it names.
fn module_graph(src: &Path) -> BTreeMap<ModPath, BTreeSet<ModPath>> {
    let mut files = Vec::new();
    sources(src, &mut files);
    let modules: BTreeSet<ModPath> = files.iter().map(|f| module_of(src, f)).collect();
    let mut graph = BTreeMap::new();
    for file in &files {
        let from = module_of(src, file);
        let text = std::fs::read_to_string(file).expect("source file");
        let uses: &mut BTreeSet<ModPath> = graph.entry(from.clone()).or_default();
        for path in crate_paths(&text) {
            let target = (1..=path.len())
                .rev()
                .map(|n| path[..n].to_vec())
                .find(|prefix| modules.contains(prefix));
            if let Some(target) = target.filter(|t| *t != from) {
                uses.insert(target);
            }
        }
    }
    graph
}

/// The graph between top-level folders (and files) of the crate.
fn folder_graph(
    graph: &BTreeMap<ModPath, BTreeSet<ModPath>>,
) -> BTreeMap<String, BTreeSet<String>> {
    let top = |m: &ModPath| m.first().cloned().unwrap_or_else(|| "main".into());
    let mut folders: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, uses) in graph {
        let edges = folders.entry(top(from)).or_default();
        edges.extend(uses.iter().map(top).filter(|t| *t != top(from)));
    }
    folders
}

/// A cycle of `graph`, if it has one.
fn find_cycle<N: Ord + Clone>(graph: &BTreeMap<N, BTreeSet<N>>) -> Option<Vec<N>> {
    fn visit<N: Ord + Clone>(
        node: &N,
        graph: &BTreeMap<N, BTreeSet<N>>,
        stack: &mut Vec<N>,
        done: &mut BTreeSet<N>,
    ) -> Option<Vec<N>> {
        if let Some(at) = stack.iter().position(|n| n == node) {
            let mut cycle = stack[at..].to_vec();
            cycle.push(node.clone());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        stack.push(node.clone());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, stack, done) {
                return Some(cycle);
            }
        }
        stack.pop();
        done.insert(node.clone());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut Vec::new(), &mut done))
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn no_module_imports_another_that_imports_it_back() {
    let graph = module_graph(&src());
    let name = |m: &ModPath| m.join("::");
    let cycle = find_cycle(&graph).map(|c| c.iter().map(name).collect::<Vec<_>>());
    assert_eq!(cycle, None, "an import cycle between modules");
}

#[test]
fn the_top_level_folders_form_no_cycle_and_cell_and_parent_stay_apart() {
    let folders = folder_graph(&module_graph(&src()));
    for (from, uses) in &folders {
        println!(
            "{from} -> {}",
            Vec::from_iter(uses.iter().cloned()).join(", ")
        );
    }
    assert_eq!(find_cycle(&folders), None, "a cycle between folders");
    assert!(!folders["cell"].contains("parent"), "cell/ imports parent/");
    assert!(!folders["parent"].contains("cell"), "parent/ imports cell/");
}

#[test]
fn the_check_sees_paths_and_groups_and_finds_cycles() {
    assert_eq!(
        crate_paths("use crate::a::{b, c::D};\nuse crate::{d::e, f}; // crate::g"),
        [
            vec!["a", "b"],
            vec!["a", "c", "D"],
            vec!["d", "e"],
            vec!["f"]
        ]
        .map(|p| p.iter().map(|s| s.to_string()).collect::<ModPath>())
    );
    let graph = BTreeMap::from([(1, BTreeSet::from([2])), (2, BTreeSet::from([1]))]);
    assert_eq!(find_cycle(&graph), Some(vec![1, 2, 1]));
    let graph = BTreeMap::from([(1, BTreeSet::from([2])), (2, BTreeSet::new())]);
    assert_eq!(find_cycle(&graph), None);
}
