"""What the benchmark scripts print about the machine beside their numbers."""

import ctypes
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


# Two threads, each pinned to its CPU, pass one cache line back and forth `n` times: the time of a
# round trip is what it costs the two CPUs to hand each other data they have just written.
_ROUND_TRIP_C = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#define LIMIT_S 1.0 /* a timing that takes longer is given up: the threads do not run at once */

static _Atomic long line __attribute__((aligned(128))); /* 2i+1: ping's turn done; -1: stop */
static long rounds;

typedef struct { int cpu, unpinned; double ns; } side;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* Pinning can fail (a CPU outside the process's set): the side then runs where it is and
   says so, so that both sides always finish their loops. */
static void pin(side *s) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(s->cpu, &set);
  s->unpinned = pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0;
}

static void *pong(void *p) {
  pin(p);
  for (long i = 0; i < rounds; i++) {
    long v;
    while ((v = atomic_load_explicit(&line, memory_order_acquire)) != 2 * i + 1)
      if (v < 0) return 0;
    long expected = 2 * i + 1; /* not over a stop written meanwhile */
    if (!atomic_compare_exchange_strong(&line, &expected, 2 * i + 2)) return 0;
  }
  return 0;
}

/* Seconds for `rounds` round trips, or -1 once LIMIT_S has passed (pong is told to stop). */
static double serve(void) {
  double start = now();
  for (long i = 0; i < rounds; i++) {
    atomic_store_explicit(&line, 2 * i + 1, memory_order_release);
    for (long spin = 1; atomic_load_explicit(&line, memory_order_acquire) != 2 * i + 2; spin++)
      if ((spin & 0xffff) == 0 && now() - start > LIMIT_S) {
        atomic_store(&line, -1);
        return -1;
      }
  }
  return now() - start;
}

static void *ping(void *p) {
  side *s = p;
  pin(s);
  double seconds = serve();
  s->ns = seconds < 0 ? -2 : seconds * 1e9 / rounds;
  return 0;
}

/* ns per round trip between cpu_a and cpu_b; -1 where a side could not be pinned or started,
   -2 where the timing took over LIMIT_S. */
double round_trip_ns(int cpu_a, int cpu_b, long n) {
  pthread_t tp, tq;
  side a = {cpu_a, 0, 0}, b = {cpu_b, 0, 0};
  if (n < 1) return -1;
  rounds = n;
  atomic_store(&line, 0);
  if (pthread_create(&tq, 0, pong, &b)) return -1;
  if (pthread_create(&tp, 0, ping, &a)) { /* walk pong to its end from this thread */
    serve();
    pthread_join(tq, 0);
    return -1;
  }
  pthread_join(tp, 0);
  pthread_join(tq, 0);
  return a.unpinned || b.unpinned ? -1 : a.ns;
}
"""


class CoreRoundTrip:
    """A cache line's round trip between the process's first two CPUs, in nanoseconds.

    On a VM the host decides where its virtual CPUs run; when it places the two far apart (on
    cores that share no cache, as two core complexes of one chip), data one thread writes reaches
    the other more slowly, and a step whose ops are split across both threads slows as a whole
    (docs/benchmarks.md, "What the slow rounds are"). Timing this beside each round tells such
    rounds apart.

    Built with the C compiler (`$CC`, else `cc`/`gcc`/`clang`) into a temporary directory. Where
    it cannot be timed (no compiler, fewer than two CPUs, a CPU that cannot be pinned, threads
    that do not run at once) a call returns None and `why_unavailable` says why.
    """

    def __init__(self):
        self.why_unavailable: str | None = None
        self._fn = None
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        compiler = next(
            (c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)),
            None,
        )
        if len(cpus) < 2:
            self.why_unavailable = "fewer than two CPUs to pass a cache line between"
        elif compiler is None:
            self.why_unavailable = "no C compiler (set CC, or install gcc)"
        else:
            self.cpus = cpus[:2]
            self._build(compiler)

    def _build(self, compiler: str) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            source, library = pathlib.Path(tmp, "round_trip.c"), pathlib.Path(tmp, "round_trip.so")
            source.write_text(_ROUND_TRIP_C)
            command = [compiler, "-O2", "-shared", "-fPIC", "-pthread", "-o", library, source]
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                self.why_unavailable = f"{compiler} failed: {result.stderr.strip()[-300:]}"
                return
            self._fn = ctypes.CDLL(str(library)).round_trip_ns  # loaded: the file may go
        self._fn.restype, self._fn.argtypes = ctypes.c_double, [ctypes.c_int] * 2 + [ctypes.c_long]

    def __call__(self, round_trips: int = 20000, repeats: int = 3) -> float | None:
        """The best of `repeats` timings of `round_trips` round trips (ns each); None where
        unavailable."""
        if self._fn is None:
            return None
        best = float("inf")
        for _ in range(repeats):
            ns = self._fn(*self.cpus, round_trips)
            if ns < 0:
                self._fn = None
                why = "do not run at once" if ns == -2 else "cannot be pinned"
                self.why_unavailable = f"threads on CPUs {self.cpus} {why}"
                return None
            best = min(best, ns)
        return best
