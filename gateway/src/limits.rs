//! Process limits the daemon raises when it starts.
//!
//! Every host queue is a socket, and every cluster connection holds a socket per OSD and
//! monitor it talks to plus its messenger threads' epoll and event descriptors. With
//! hundreds of host connections or a large cluster the soft open-file limit (1024 on a stock
//! Debian login) runs out long before the hard one, and then accepts and new cluster
//! connections fail with EMFILE (ceph-nvmeof issue 309: "Too many open files" with 3000
//! namespaces). Ceph's own daemons raise theirs (`max_open_files`); the gateway raises the
//! soft limit to the hard limit, which the admin (systemd `LimitNOFILE=`, the container
//! runtime) controls.

use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};

/// The soft open-file limit before and after [`raise_open_file_limit`]; `None` is unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFileLimit {
    pub before: Option<u64>,
    pub after: Option<u64>,
    pub hard: Option<u64>,
}

/// Raises the soft open-file limit to the hard limit.
pub fn raise_open_file_limit() -> std::io::Result<OpenFileLimit> {
    let limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: limit.maximum,
                maximum: limit.maximum,
            },
        )?;
    }
    Ok(OpenFileLimit {
        before: limit.current,
        after: getrlimit(Resource::Nofile).current,
        hard: limit.maximum,
    })
}
