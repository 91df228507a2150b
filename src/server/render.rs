//! `/metrics` renders, shared between the scrapes that wait for them.
//!
//! Rendering is CPU (the process's own figures read `/proc` on every render), so it runs on
//! the blocking pool, never on the threads that answer probes, and one render at a time.
//! Scrapes that arrive while a render runs do not each queue a render of their own: they
//! wait for the next one together, and it answers all of them. A flood of scrapes (clients
//! that pipeline requests, say) then costs at most one render per render's time, and a
//! scrape waits for at most the render running when it came and its own, however many
//! scrapes came with it. Every answer is rendered after its request arrived: a scrape just
//! after a change sees it.

use std::sync::{Arc, Mutex, PoisonError};

use axum::body::Bytes;
use futures::FutureExt;
use futures::future::{BoxFuture, Shared};

/// Renders the metrics in OpenMetrics text (`true`), or else in Prometheus text.
pub type Render = dyn Fn(bool) -> String + Send + Sync;

/// A render that has not started yet, and everyone waiting for it. `None` when the render
/// could not be done (the runtime is shutting down, or rendering panicked).
type Flight = Shared<BoxFuture<'static, Option<Bytes>>>;

pub struct Renders {
    render: Arc<Render>,
    /// Per format (Prometheus text, OpenMetrics), the render the next scrapes join.
    next: Mutex<[Option<Flight>; 2]>,
    /// One render at a time, whatever the format.
    turn: tokio::sync::Semaphore,
}

impl Renders {
    pub fn new(render: Arc<Render>) -> Arc<Renders> {
        Arc::new(Renders {
            render,
            next: Mutex::new([None, None]),
            turn: tokio::sync::Semaphore::new(1),
        })
    }

    /// The metrics, rendered after this call began. Must be called within a Tokio runtime.
    pub async fn get(self: &Arc<Self>, openmetrics: bool) -> Option<Bytes> {
        let flight = self.next.lock().unwrap_or_else(PoisonError::into_inner)
            [usize::from(openmetrics)]
        .get_or_insert_with(|| self.clone().start(openmetrics))
        .clone();
        flight.await
    }

    /// A render, queued for its turn. A task of its own: it is done even when the scrapes
    /// that wait for it have gone (whoever comes next may still join it).
    fn start(self: Arc<Self>, openmetrics: bool) -> Flight {
        let task = tokio::spawn(async move {
            let _turn = self.turn.acquire().await.ok()?;
            // Started: a scrape from now on may expect what this render can no longer see.
            // It waits for the next one. Only this flight is in its slot until it starts.
            self.next.lock().unwrap_or_else(PoisonError::into_inner)[usize::from(openmetrics)] =
                None;
            let render = self.render.clone();
            tokio::task::spawn_blocking(move || Bytes::from(render(openmetrics)))
                .await
                .ok()
        });
        async move { task.await.ok().flatten() }.boxed().shared()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    use super::*;

    /// A render that takes `took`, counts itself, and tells the state it began with and
    /// whether it was asked for OpenMetrics.
    fn slow(took: Duration, state: Arc<AtomicU64>, renders: Arc<AtomicU64>) -> Arc<Renders> {
        Renders::new(Arc::new(move |openmetrics| {
            let seen = state.load(Ordering::SeqCst);
            renders.fetch_add(1, Ordering::SeqCst);
            std::thread::sleep(took);
            format!("state {seen} openmetrics {openmetrics}")
        }))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn scrapes_that_come_during_a_render_share_the_next_one_and_see_what_came_before_them() {
        let (state, renders) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let pool = slow(Duration::from_millis(200), state.clone(), renders.clone());
        let first = tokio::spawn({
            let pool = pool.clone();
            async move { pool.get(false).await }
        });
        while renders.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // A change while the first render runs, then a flood of scrapes.
        state.store(1, Ordering::SeqCst);
        let flood: Vec<_> = (0..100)
            .map(|_| {
                let pool = pool.clone();
                tokio::spawn(async move { pool.get(false).await })
            })
            .collect();
        assert_eq!(first.await.unwrap().unwrap(), "state 0 openmetrics false");
        for scrape in flood {
            // Never the render that began before the change.
            assert_eq!(scrape.await.unwrap().unwrap(), "state 1 openmetrics false");
        }
        assert_eq!(
            renders.load(Ordering::SeqCst),
            2,
            "a render for the flood, not 100"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_format_is_rendered_as_asked_one_render_at_a_time() {
        let renders = Arc::new(AtomicU64::new(0));
        let running = Arc::new(AtomicU64::new(0));
        let most = Arc::new(AtomicU64::new(0));
        let pool = Renders::new(Arc::new({
            let (running, most, renders) = (running.clone(), most.clone(), renders.clone());
            move |openmetrics| {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                renders.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(50));
                running.fetch_sub(1, Ordering::SeqCst);
                format!("openmetrics {openmetrics}")
            }
        }));
        let scrapes: Vec<_> = (0..20)
            .map(|i| {
                let pool = pool.clone();
                tokio::spawn(async move { (i % 2 == 1, pool.get(i % 2 == 1).await) })
            })
            .collect();
        for scrape in scrapes {
            let (openmetrics, body) = scrape.await.unwrap();
            assert_eq!(body.unwrap(), format!("openmetrics {openmetrics}"));
        }
        assert_eq!(most.load(Ordering::SeqCst), 1, "renders overlapped");
        assert!(renders.load(Ordering::SeqCst) <= 4, "{renders:?} renders");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_render_whose_scrapes_left_is_still_done_and_the_next_scrape_renders_again() {
        let (state, renders) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let pool = slow(Duration::from_millis(50), state.clone(), renders.clone());
        // A scrape that gives up at once.
        let _ = tokio::time::timeout(Duration::from_millis(1), pool.get(true)).await;
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(renders.load(Ordering::SeqCst), 1);
        state.store(7, Ordering::SeqCst);
        assert_eq!(
            pool.get(true).await.unwrap(),
            "state 7 openmetrics true",
            "a finished render is never handed out again"
        );
    }
}
