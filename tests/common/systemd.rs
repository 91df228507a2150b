//! A stand-in for the host's `kubelet-ca-agent-kubelet-restart.path` and its service: it
//! watches the request directory, takes each request as the service does (renames it to
//! `taken`), records it, takes a while as `systemctl restart kubelet.service` would, and
//! writes the result line the test chose (`success exited 0`, `exit-code exited 1`) by
//! rename, as the service's ExecStopPost= does.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

pub struct FakeHost {
    pub dir: PathBuf,
    taken: Arc<Mutex<usize>>,
    result: Arc<Mutex<String>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl FakeHost {
    /// Takes the requests written in `dir` (made if missing), each restart taking `takes`.
    pub fn start(dir: &Path, takes: Duration) -> FakeHost {
        std::fs::create_dir_all(dir).unwrap();
        let taken = Arc::new(Mutex::new(0));
        let result = Arc::new(Mutex::new("success exited 0".to_string()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (dir, taken, result, stop) = (
                dir.to_path_buf(),
                taken.clone(),
                result.clone(),
                stop.clone(),
            );
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if std::fs::rename(dir.join("request"), dir.join("taken")).is_ok() {
                        *taken.lock().unwrap() += 1;
                        std::thread::sleep(takes);
                        let line = result.lock().unwrap().clone();
                        std::fs::write(dir.join(".result.new"), format!("{line}\n")).unwrap();
                        std::fs::rename(dir.join(".result.new"), dir.join("result")).unwrap();
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        };
        FakeHost {
            dir: dir.to_path_buf(),
            taken,
            result,
            stop,
            thread: Some(thread),
        }
    }

    /// How many requests were taken so far.
    pub fn taken(&self) -> usize {
        *self.taken.lock().unwrap()
    }

    /// The result line of the next restarts.
    pub fn set_result(&self, line: &str) {
        *self.result.lock().unwrap() = line.to_string();
    }
}

impl Drop for FakeHost {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
