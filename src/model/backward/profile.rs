//! The backward's per-step timer: with `ATTNSCOPE_PROFILE_BACKWARD=1` each forward and backward
//! of [`crate::model::Model::gradient`] (and its batched kin) prints to stderr the seconds spent
//! in each named step, summed over the layers. Off (the default), a lap is one branch.

use std::time::Instant;

/// Seconds per named step since the run began, in the order the steps first ran.
pub(super) struct Profile {
    on: bool,
    last: Instant,
    acc: Vec<(&'static str, f64)>,
}

impl Default for Profile {
    fn default() -> Profile {
        Profile {
            on: std::env::var_os("ATTNSCOPE_PROFILE_BACKWARD").is_some_and(|v| v == "1"),
            last: Instant::now(),
            acc: Vec::new(),
        }
    }
}

impl Profile {
    /// The time since the last lap, added to `step`'s.
    pub(super) fn lap(&mut self, step: &'static str) {
        if !self.on {
            return;
        }
        let now = Instant::now();
        let dt = now.duration_since(self.last).as_secs_f64();
        self.last = now;
        match self.acc.iter_mut().find(|(s, _)| *s == step) {
            Some((_, t)) => *t += dt,
            None => self.acc.push((step, dt)),
        }
    }

    /// Prints the steps' times (and their total) to stderr, if profiling is on.
    pub(super) fn report(&self, rows: usize) {
        if !self.on {
            return;
        }
        let total: f64 = self.acc.iter().map(|(_, t)| t).sum();
        eprintln!("backward profile, {rows} rows: {total:.3} s");
        for (step, t) in &self.acc {
            eprintln!(
                "  {step:<28} {t:>8.3} s {:>5.1}%",
                100.0 * t / total.max(1e-12)
            );
        }
    }
}
