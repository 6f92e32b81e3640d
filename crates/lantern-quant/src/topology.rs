//! The CPU topology lantern runs on, as Linux describes it under `/sys/devices/system`:
//! the logical CPUs this process may run on (its affinity), the physical cores they
//! belong to (distinct `(package, core_id)` pairs), the hardware threads per core (SMT
//! siblings), the sockets, and the NUMA nodes with their CPUs and memory.
//!
//! Read for `--verbose` and `lantern bench`, and to warn when a process spans several
//! NUMA nodes (lantern does not place threads or weights per node: each node then reads
//! some weights from another node's memory). Whatever cannot be read (no `/sys`, another
//! OS, a container that hides it) is `None` and shown as "unknown"; reading never fails.
//!
//! [`Topology::read_from`] takes the root of the file tree (`/` for the real one) so that
//! tests can point it at a fake one.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;

/// One NUMA node: its id, CPUs (all of them, not only those this process may use) and
/// memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NumaNode {
    pub id: usize,
    pub cpus: Vec<usize>,
    pub memory_bytes: Option<u64>,
}

/// What [`Topology::read`] found. Counts are over the CPUs this process may run on.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Topology {
    /// The logical CPUs this process may run on (its affinity), sorted.
    pub allowed_cpus: Option<Vec<usize>>,
    /// Distinct `(package, core_id)` pairs among the allowed CPUs.
    pub physical_cores: Option<usize>,
    /// Hardware threads per core (SMT siblings, whether or not this process may use
    /// them): the most any allowed core has.
    pub threads_per_core: Option<usize>,
    /// Distinct packages among the allowed CPUs.
    pub sockets: Option<usize>,
    /// Every NUMA node of the machine, by id; empty when unknown.
    pub numa_nodes: Vec<NumaNode>,
    /// Threads of lantern's compute pool, when the caller says ([`Topology::with_compute_threads`]).
    pub compute_threads: Option<usize>,
}

impl Topology {
    /// The topology of this machine and process. Where the affinity cannot be read, the
    /// logical CPUs are those [`std::thread::available_parallelism`] reports.
    pub fn read() -> Topology {
        let mut topology = Topology::read_from(Path::new("/"));
        if topology.allowed_cpus.is_none() {
            if let Ok(n) = std::thread::available_parallelism() {
                topology.allowed_cpus = Some((0..n.get()).collect());
            }
        }
        topology
    }

    /// The topology described by the files under `root` (`proc/self/status`,
    /// `sys/devices/system/cpu`, `sys/devices/system/node`).
    pub fn read_from(root: &Path) -> Topology {
        let cpu_dir = root.join("sys/devices/system/cpu");
        let node_dir = root.join("sys/devices/system/node");
        let allowed = read_allowed_cpus(root).or_else(|| {
            std::fs::read_to_string(cpu_dir.join("online"))
                .ok()
                .and_then(|s| parse_cpu_list(&s))
        });

        // (package, core) of each allowed CPU, and that core's hardware threads.
        let mut cores: BTreeMap<(usize, usize), usize> = BTreeMap::new();
        let mut complete = allowed.is_some();
        for &cpu in allowed.as_deref().unwrap_or(&[]) {
            let dir = cpu_dir.join(format!("cpu{cpu}/topology"));
            let read_id = |name: &str| -> Option<usize> {
                std::fs::read_to_string(dir.join(name))
                    .ok()?
                    .trim()
                    .parse()
                    .ok()
            };
            let (Some(package), Some(core)) = (read_id("physical_package_id"), read_id("core_id"))
            else {
                complete = false;
                break;
            };
            let siblings = ["thread_siblings_list", "core_cpus_list"]
                .iter()
                .find_map(|name| {
                    std::fs::read_to_string(dir.join(name))
                        .ok()
                        .and_then(|s| parse_cpu_list(&s))
                })
                .map_or(1, |list| list.len().max(1));
            let entry = cores.entry((package, core)).or_insert(0);
            *entry = (*entry).max(siblings);
        }
        let (physical_cores, threads_per_core, sockets) = if complete && !cores.is_empty() {
            let packages: BTreeSet<usize> = cores.keys().map(|&(p, _)| p).collect();
            (
                Some(cores.len()),
                cores.values().copied().max(),
                Some(packages.len()),
            )
        } else {
            (None, None, None)
        };

        Topology {
            allowed_cpus: allowed,
            physical_cores,
            threads_per_core,
            sockets,
            numa_nodes: read_numa_nodes(&node_dir),
            compute_threads: None,
        }
    }

    /// The same, saying that lantern's compute pool has `threads` threads.
    pub fn with_compute_threads(mut self, threads: usize) -> Topology {
        self.compute_threads = Some(threads);
        self
    }

    /// How many logical CPUs this process may run on.
    pub fn logical_cpus(&self) -> Option<usize> {
        self.allowed_cpus.as_ref().map(Vec::len)
    }

    /// The NUMA nodes holding CPUs this process may run on (all nodes when the affinity
    /// is unknown).
    pub fn nodes_in_use(&self) -> Vec<&NumaNode> {
        self.numa_nodes
            .iter()
            .filter(|node| match &self.allowed_cpus {
                Some(allowed) => node.cpus.iter().any(|c| allowed.binary_search(c).is_ok()),
                None => !node.cpus.is_empty(),
            })
            .collect()
    }

    /// One line of advice when this process may run on CPUs of several NUMA nodes, else
    /// `None`.
    pub fn numa_warning(&self) -> Option<String> {
        let nodes = self.nodes_in_use();
        if nodes.len() < 2 {
            return None;
        }
        // Physical cores of the smallest node, when the SMT width is known.
        let per_node = nodes
            .iter()
            .map(|n| n.cpus.len() / self.threads_per_core.unwrap_or(1).max(1))
            .min()
            .unwrap_or(1)
            .max(1);
        Some(format!(
            "this process may run on {} NUMA nodes, and lantern places neither its threads nor \
             the weights they read per node, so some cores read another node's memory: run one \
             server per node (`numactl --cpunodebind=N --membind=N lantern serve ...`), or keep \
             `--threads` at most the cores of one node ({per_node})",
            nodes.len()
        ))
    }
}

impl fmt::Display for Topology {
    /// `2 logical CPUs, 2 physical cores (1 per core), 1 socket, 1 NUMA node; compute pool 2 threads`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let plural =
            |n: usize, one: &str, many: &str| format!("{n} {}", if n == 1 { one } else { many });
        match self.logical_cpus() {
            Some(n) => write!(f, "{}", plural(n, "logical CPU", "logical CPUs"))?,
            None => write!(f, "logical CPUs unknown")?,
        }
        match (self.physical_cores, self.threads_per_core) {
            (Some(c), Some(t)) => write!(
                f,
                ", {} ({t} per core)",
                plural(c, "physical core", "physical cores")
            )?,
            (Some(c), None) => write!(f, ", {}", plural(c, "physical core", "physical cores"))?,
            (None, _) => write!(f, ", physical cores unknown")?,
        }
        match self.sockets {
            Some(s) => write!(f, ", {}", plural(s, "socket", "sockets"))?,
            None => write!(f, ", sockets unknown")?,
        }
        match self.numa_nodes.len() {
            0 => write!(f, ", NUMA nodes unknown")?,
            1 => write!(f, ", 1 NUMA node")?,
            n => {
                write!(f, ", {n} NUMA nodes (")?;
                for (i, node) in self.numa_nodes.iter().enumerate() {
                    if i > 0 {
                        write!(f, "; ")?;
                    }
                    write!(f, "{}: CPUs {}", node.id, format_cpu_list(&node.cpus))?;
                    if let Some(bytes) = node.memory_bytes {
                        write!(f, ", {:.1} GiB", bytes as f64 / (1u64 << 30) as f64)?;
                    }
                }
                write!(f, ")")?;
            }
        }
        if let Some(t) = self.compute_threads {
            write!(f, "; compute pool {}", plural(t, "thread", "threads"))?;
        }
        Ok(())
    }
}

/// Parses a Linux CPU list (`0-3,8-11`, `5`) into sorted, distinct CPU ids. `None` when it is not one; an empty string is an empty list.
pub fn parse_cpu_list(s: &str) -> Option<Vec<usize>> {
    let mut cpus = BTreeSet::new();
    for part in s.trim().split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
                if a > b || b - a > 1 << 16 {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => {
                cpus.insert(part.parse().ok()?);
            }
        }
    }
    Some(cpus.into_iter().collect())
}

/// Writes sorted CPU ids as a Linux CPU list (`0-3,8-11`).
pub fn format_cpu_list(cpus: &[usize]) -> String {
    let mut out = String::new();
    let mut i = 0;
    while i < cpus.len() {
        let mut j = i;
        while j + 1 < cpus.len() && cpus[j + 1] == cpus[j] + 1 {
            j += 1;
        }
        if !out.is_empty() {
            out.push(',');
        }
        if j == i {
            out.push_str(&cpus[i].to_string());
        } else {
            out.push_str(&format!("{}-{}", cpus[i], cpus[j]));
        }
        i = j + 1;
    }
    out
}

/// The CPUs this process may run on: `Cpus_allowed_list` of `/proc/self/status` (the
/// affinity `sched_getaffinity` returns).
fn read_allowed_cpus(root: &Path) -> Option<Vec<usize>> {
    let status = std::fs::read_to_string(root.join("proc/self/status")).ok()?;
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    parse_cpu_list(line).filter(|cpus| !cpus.is_empty())
}

fn read_numa_nodes(node_dir: &Path) -> Vec<NumaNode> {
    let Ok(entries) = std::fs::read_dir(node_dir) else {
        return Vec::new();
    };
    let mut nodes: Vec<NumaNode> = entries
        .filter_map(|e| {
            let e = e.ok()?;
            let id: usize = e.file_name().to_str()?.strip_prefix("node")?.parse().ok()?;
            let dir = e.path();
            let cpus = std::fs::read_to_string(dir.join("cpulist"))
                .ok()
                .and_then(|s| parse_cpu_list(&s))
                .unwrap_or_default();
            let memory_bytes = std::fs::read_to_string(dir.join("meminfo"))
                .ok()
                .and_then(|s| node_mem_total(&s));
            Some(NumaNode {
                id,
                cpus,
                memory_bytes,
            })
        })
        .collect();
    nodes.sort_by_key(|n| n.id);
    nodes
}

/// `Node 0 MemTotal:       16083160 kB` in bytes.
fn node_mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.contains("MemTotal:"))?;
    let mut words = line.split(':').nth(1)?.split_whitespace();
    let value: u64 = words.next()?.parse().ok()?;
    let unit = match words.next() {
        Some("kB") | Some("KB") => 1024,
        None => 1,
        Some(_) => return None,
    };
    Some(value * unit)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fake file tree under the system's temporary directory, removed on drop.
    struct FakeRoot(PathBuf);

    impl FakeRoot {
        fn new() -> FakeRoot {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "lantern-topology-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&dir).unwrap();
            FakeRoot(dir)
        }

        fn write(&self, path: &str, text: &str) {
            let path = self.0.join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }

        /// A CPU with its package, core and hardware siblings.
        fn cpu(&self, cpu: usize, package: usize, core: usize, siblings: &str) {
            let dir = format!("sys/devices/system/cpu/cpu{cpu}/topology");
            self.write(
                &format!("{dir}/physical_package_id"),
                &format!("{package}\n"),
            );
            self.write(&format!("{dir}/core_id"), &format!("{core}\n"));
            self.write(
                &format!("{dir}/thread_siblings_list"),
                &format!("{siblings}\n"),
            );
        }

        fn node(&self, id: usize, cpus: &str, kib: u64) {
            let dir = format!("sys/devices/system/node/node{id}");
            self.write(&format!("{dir}/cpulist"), &format!("{cpus}\n"));
            self.write(
                &format!("{dir}/meminfo"),
                &format!("Node {id} MemTotal:       {kib} kB\nNode {id} MemFree:        1000 kB\n"),
            );
        }

        fn allowed(&self, cpus: &str) {
            self.write(
                "proc/self/status",
                &format!("Name:\tlantern\nCpus_allowed:\tff\nCpus_allowed_list:\t{cpus}\nMems_allowed_list:\t0\n"),
            );
        }
    }

    impl Drop for FakeRoot {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn cpu_lists_parse_and_format() {
        assert_eq!(
            parse_cpu_list("0-3,8-11\n"),
            Some(vec![0, 1, 2, 3, 8, 9, 10, 11])
        );
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list("3,1,2-2"), Some(vec![1, 2, 3]));
        assert_eq!(parse_cpu_list(""), Some(vec![]));
        assert_eq!(parse_cpu_list("0-x"), None);
        assert_eq!(parse_cpu_list("4-2"), None);
        assert_eq!(format_cpu_list(&[0, 1, 2, 3, 8, 9, 10, 11]), "0-3,8-11");
        assert_eq!(format_cpu_list(&[0, 2, 3, 5]), "0,2-3,5");
        assert_eq!(format_cpu_list(&[]), "");
    }

    #[test]
    fn a_small_machine_reads_as_lscpu_says() {
        // 2 cores, no SMT, one socket, one node: the machine the 2-core figures ran on.
        let root = FakeRoot::new();
        root.allowed("0-1");
        root.write("sys/devices/system/cpu/online", "0-1\n");
        root.cpu(0, 0, 0, "0");
        root.cpu(1, 0, 1, "1");
        root.node(0, "0-1", 16083160);
        let t = Topology::read_from(&root.0).with_compute_threads(2);
        assert_eq!(t.logical_cpus(), Some(2));
        assert_eq!(t.physical_cores, Some(2));
        assert_eq!(t.threads_per_core, Some(1));
        assert_eq!(t.sockets, Some(1));
        assert_eq!(t.numa_nodes[0].memory_bytes, Some(16083160 * 1024));
        assert_eq!(
            t.to_string(),
            "2 logical CPUs, 2 physical cores (1 per core), 1 socket, 1 NUMA node; compute pool 2 threads"
        );
        assert_eq!(t.numa_warning(), None);
    }

    /// Two sockets, each one NUMA node of 4 cores with 2 hardware threads each; Linux
    /// numbers the first thread of every core first (0-7), then their siblings (8-15).
    fn two_socket_machine(root: &FakeRoot) {
        root.write("sys/devices/system/cpu/online", "0-15\n");
        for cpu in 0..16 {
            let core = cpu % 8;
            let package = core / 4;
            root.cpu(cpu, package, core % 4, &format!("{core},{}", core + 8));
        }
        root.node(0, "0-3,8-11", 64 << 20);
        root.node(1, "4-7,12-15", 64 << 20);
    }

    #[test]
    fn smt_sockets_and_numa_nodes_are_counted_and_warned_about() {
        let root = FakeRoot::new();
        two_socket_machine(&root);
        root.allowed("0-15");
        let t = Topology::read_from(&root.0);
        assert_eq!(t.logical_cpus(), Some(16));
        assert_eq!(t.physical_cores, Some(8));
        assert_eq!(t.threads_per_core, Some(2));
        assert_eq!(t.sockets, Some(2));
        assert_eq!(t.numa_nodes.len(), 2);
        assert_eq!(t.numa_nodes[1].cpus, vec![4, 5, 6, 7, 12, 13, 14, 15]);
        assert_eq!(
            t.to_string(),
            "16 logical CPUs, 8 physical cores (2 per core), 2 sockets, 2 NUMA nodes \
             (0: CPUs 0-3,8-11, 64.0 GiB; 1: CPUs 4-7,12-15, 64.0 GiB)"
        );
        let warning = t.numa_warning().expect("two nodes in use");
        assert!(
            warning.contains("numactl --cpunodebind=N --membind=N"),
            "{warning}"
        );
        assert!(warning.contains("cores of one node (4)"), "{warning}");
    }

    #[test]
    fn a_process_bound_to_one_node_counts_its_own_cpus_and_is_not_warned() {
        // As under `numactl --cpunodebind=1`: the affinity is node 1's CPUs.
        let root = FakeRoot::new();
        two_socket_machine(&root);
        root.allowed("4-7,12-15");
        let t = Topology::read_from(&root.0);
        assert_eq!(t.logical_cpus(), Some(8));
        assert_eq!(t.physical_cores, Some(4));
        assert_eq!(t.sockets, Some(1));
        assert_eq!(t.nodes_in_use().len(), 1);
        assert_eq!(t.numa_warning(), None);
    }

    #[test]
    fn without_the_affinity_the_online_cpus_count() {
        let root = FakeRoot::new();
        root.write("sys/devices/system/cpu/online", "0-3\n");
        for cpu in 0..4 {
            root.cpu(
                cpu,
                0,
                cpu / 2,
                &format!("{}-{}", cpu / 2 * 2, cpu / 2 * 2 + 1),
            );
        }
        let t = Topology::read_from(&root.0);
        assert_eq!(t.logical_cpus(), Some(4));
        assert_eq!(t.physical_cores, Some(2));
        assert_eq!(t.threads_per_core, Some(2));
        // No node directory: a kernel without NUMA support.
        assert!(t.numa_nodes.is_empty());
        assert_eq!(
            t.to_string(),
            "4 logical CPUs, 2 physical cores (2 per core), 1 socket, NUMA nodes unknown"
        );
    }

    #[test]
    fn a_missing_tree_reads_as_unknown_without_panicking() {
        let root = FakeRoot::new();
        let t = Topology::read_from(&root.0.join("nothing here"));
        assert_eq!(t, Topology::default());
        assert_eq!(
            t.to_string(),
            "logical CPUs unknown, physical cores unknown, sockets unknown, NUMA nodes unknown"
        );
        assert_eq!(t.numa_warning(), None);

        // CPUs listed but their topology hidden (some containers): cores unknown.
        let root = FakeRoot::new();
        root.allowed("0-3");
        root.write("sys/devices/system/cpu/cpu0/topology/core_id", "0\n");
        let t = Topology::read_from(&root.0).with_compute_threads(1);
        assert_eq!(
            t.to_string(),
            "4 logical CPUs, physical cores unknown, sockets unknown, NUMA nodes unknown; \
             compute pool 1 thread"
        );
    }

    #[test]
    fn this_machine_reads_without_panicking() {
        let t = Topology::read();
        assert!(t.logical_cpus().unwrap_or(1) >= 1);
        assert!(!t.to_string().is_empty());
    }
}
