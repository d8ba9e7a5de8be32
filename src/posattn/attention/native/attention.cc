// posattn's CPU attention kernel: softmax(scale q k^T + bias) v, forward and backward, as XLA FFI
// custom calls (posattn/attention/native/__init__.py builds and registers it; docs/attention.md).
//
// Shape legend: B batch, T queries, S keys, N query heads, K key/value heads, G = N / K, H head
// dim. Layouts are row-major: q, out, dq [B, T, N, H]; k, v, dk, dv [B, S, K, H]; the logit bias
// and its gradient [Bb, Nb, T, S] with Bb in {1, B} and Nb in {1, N} (broadcast), or empty;
// the forward's row statistics m (guarded row max) and inv_l (1 / row sum) [B, N, T].
//
// The math is the chunked kernel's (posattn/attention/chunked.py, FlashAttention-2's equations
// with a whole row as one tile): s = scale q.k + bias (-inf hides a key; with a soft cap c,
// Gemma 2's, s = c tanh(scale q.k / c) + bias and ds reaches dq and dk times the cap's slope
// 1 - tanh^2, the bias gradient without it), m = max(s) (0 for a
// row that sees no key), p = exp(s - m), l = sum(p), out = (p v) / l. Backward: p is recomputed
// as exp(s - m) * inv_l, dv = p^T dO, dp = dO v^T, D = rowsum(p * dp), ds = p * (dp - D),
// dq = scale ds k, dk = scale ds^T q, dbias = ds summed over the rows and heads it broadcasts to.
//
// What makes it fast where XLA:CPU is not: per (batch row, key/value head) the keys are packed
// once ([H, S] transposed, so that a query row's logits are FMAs over contiguous keys), every pass
// over a row block happens while its logits are in L1, causal and windowed rows only visit the
// keys they can see (a static offset: `causal_offset`, `window`), nothing [T, S]-sized is
// written to memory except the bias gradient when one is asked for, and the vectors are the
// widest the CPU has (16 floats with AVX-512, 8 otherwise; the same bits).
//
// Determinism: work is split into items that each own disjoint outputs (a bias gradient shared by
// batch rows or heads is owned by one item that visits them in order), so results do not depend
// on the number of threads or on scheduling.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kW = 16;  // keys per block of the logits' products (RowDots)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Eight float32 lanes (GCC vector extensions: AVX2's ymm; other ISAs get the same code), written
// out so that the code vectorises whatever the compiler's heuristics. A row's sums and maxima are
// accumulated in these lanes, key j in lane j % 8, whatever vector the pass reads.
typedef float vf __attribute__((vector_size(32)));
constexpr int kV = 8;
// The wide vector the passes and products run on: 16 lanes (one zmm) where the CPU has AVX-512,
// else vf. Each lane's arithmetic is the same at either width and the sums keep vf's order
// (`AddInOrder`), so the results are the same bits on either kind of CPU.
#if defined(__AVX512F__)
constexpr int kL = 16;
#else
constexpr int kL = kV;
#endif
typedef float vw __attribute__((vector_size(4 * kL)));

template <typename V>
constexpr int Lanes() {
  return sizeof(V) / sizeof(float);
}
template <typename V = vf>
inline V Splat(float x) {
  return x - V{};  // x in every lane (x - 0 is x, -0 included); one broadcast
}
template <typename V = vf>
inline V Load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
// x opaque to the compiler: kept in one vector register, its value unknown to the optimiser.
template <typename V>
inline void Opaque(V& x) {
#if defined(__AVX512F__)
  asm("" : "+v"(x));
#elif defined(__AVX__)
  asm("" : "+x"(x));
#endif
}
// A vector that R rows' FMAs read: for R > 1 loaded once into a register the compiler must keep
// (GCC otherwise folds the load into every row's FMA, and the loop is bound by loads); for one row
// the load folded into its FMA is best.
template <int R, typename V>
inline V LoadShared(const float* p) {
  V v = Load<V>(p);
  if constexpr (R > 1) Opaque(v);
  return v;
}
template <typename V>
inline void Store(float* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}
// Lane i of the result: first + i.
template <typename V>
inline auto Iota(int32_t first) {
  static constexpr int32_t kLanes[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  static_assert(Lanes<V>() <= 16);
  decltype(V{} < V{}) v;
  std::memcpy(&v, kLanes, sizeof(v));
  return v + first;
}
// vf's lanes I * kV .. I * kV + kV - 1 of a wide vector (a register extract, not a round trip
// through memory).
static_assert(kL == kV || kL == 2 * kV, "a wide vector is one or two vf");
template <int I>
inline vf Part(const vw& x) {
  static_assert(I * kV < kL, "a part of the vector");
  constexpr int o = I * kV;
  return __builtin_shufflevector(x, x, o, o + 1, o + 2, o + 3, o + 4, o + 5, o + 6, o + 7);
}
// acc += x in vf's lanes, the low lanes first: key j adds into lane j % kV in increasing j, as a
// pass of vf would add it.
inline void AddInOrder(vf& acc, const vw& x) {
  acc += Part<0>(x);
  if constexpr (kL > kV) acc += Part<1>(x);
}
// acc += x * y in vf's lanes, each lane's product and sum one FMA as in a pass of vf.
inline void AddProductInOrder(vf& acc, const vw& x, const vw& y) {
  acc += Part<0>(x) * Part<0>(y);
  if constexpr (kL > kV) acc += Part<1>(x) * Part<1>(y);
}
inline vf Max(vf a, vf b) { return a > b ? a : b; }
inline void MaxInOrder(vf& acc, const vw& x) {
  acc = Max(Part<0>(x), acc);
  if constexpr (kL > kV) acc = Max(Part<1>(x), acc);
}
inline float HorizontalMax(vf v) {
  float m = v[0];
  for (int i = 1; i < kV; ++i) m = std::max(m, v[i]);
  return m;
}
inline float HorizontalSum(vf v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// exp(x) in float32 to ~1 ulp (Cephes' expf polynomial after x = n ln 2 + r, the rounding to n
// by adding 1.5 * 2^23); x = -inf (a hidden key), or anything below float's range, gives 0.
template <typename V>
inline V Exp(V x) {
  using I = decltype(x < x);  // int32 lanes
  const V lo = Splat<V>(-87.5f), hi = Splat<V>(88.5f), magic = Splat<V>(12582912.0f);
  const I under = x < lo;
  V c = x < lo ? lo : x;
  c = c > hi ? hi : c;
  const V t = c * 1.44269504088896341f + magic;
  const V n = t - magic;
  V r = c - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const V z = r * r;
  V y = Splat<V>(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const I bits = (((I)t - (I)magic) + 127) << 23;
  return under ? Splat<V>(0.0f) : y * (V)bits;
}

// Runs fn(item) for item in [0, n) on the caller and XLA's intra-op threads. The caller takes
// items too and waits only for the items, never for a task to start, so a busy (or one-thread)
// pool cannot deadlock it; late tasks find nothing left and return.
template <typename Pool, typename Fn>
void ParallelFor(Pool& pool, int64_t n, const Fn& fn) {
  const int64_t threads = std::min<int64_t>(pool.num_threads(), n);
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, n, &fn]() {
    int64_t finished = 0;
    for (int64_t i; (i = shared->next.fetch_add(1)) < n;) {
      fn(i);
      ++finished;
    }
    if (finished && shared->done.fetch_add(finished) + finished == n) {
      std::lock_guard<std::mutex> lock(shared->mu);
      shared->cv.notify_all();
    }
  };
  // A task that starts after the caller returned touches only `shared` (kept alive by its copy),
  // never `fn`: it finds no item left.
  for (int64_t t = 1; t < threads; ++t) {
    pool.Schedule([shared, n, work]() {
      if (shared->next.load() >= n) return;
      work();
    });
  }
  work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == n; });
}

// Per-thread scratch, grown on demand and reused by every item and call on that thread (its
// contents are overwritten before they are read: the packers zero their padding).
float* Scratch(int slot, size_t floats) {
  thread_local std::vector<float> buffers[9];
  std::vector<float>& buffer = buffers[slot];
  if (buffer.size() < floats) buffer.resize(floats);
  return buffer.data();
}

struct Dims {
  int64_t B, T, S, N, K, H, G, Bb, Nb;
  bool has_bias;
  bool causal;
  int64_t offset;  // position of query 0 (static)
  int64_t window;  // 0: none; causal windows only
  float scale;
  float softcap;  // 0: none; else the content logits become softcap * tanh(s / softcap)
};

// The keys query t may see by position (causal, window); the bias may hide more.
inline void KeyRange(const Dims& d, int64_t t, int64_t* lo, int64_t* hi) {
  const int64_t pos = d.offset + t;
  *hi = d.causal ? std::min<int64_t>(d.S, pos + 1) : d.S;
  *lo = (d.causal && d.window > 0) ? std::max<int64_t>(0, pos - d.window + 1) : 0;
  if (*hi < 0) *hi = 0;
  if (*lo > *hi) *lo = *hi;
}

inline const float* BiasSlice(const Dims& d, const float* bias, int64_t b, int64_t n) {
  if (!d.has_bias) return nullptr;
  const int64_t bb = d.Bb == 1 ? 0 : b, nb = d.Nb == 1 ? 0 : n;
  return bias + (bb * d.Nb + nb) * d.T * d.S;
}

// Packs rows x[b, :, kh, :] ([S, H], stride K * H) transposed by blocks of kW keys into
// out[Sp / kW, H, kW] (zero padded), so that a block of keys' products reads one contiguous run.
template <int H>
void PackTransposed(const Dims& d, const float* x, int64_t b, int64_t kh, int64_t Sp, float* out) {
  std::fill(out, out + H * Sp, 0.0f);
  for (int64_t s = 0; s < d.S; ++s) {
    const float* row = x + ((b * d.S + s) * d.K + kh) * H;
    float* col = out + (s / kW) * H * kW + s % kW;
    for (int h = 0; h < H; ++h) col[h * kW] = row[h];
  }
}

// Copies rows x[b, :, kh, :] into out[Sp, H] (contiguous, the rows past S zero).
template <int H>
void PackRows(const Dims& d, const float* x, int64_t b, int64_t kh, int64_t Sp, float* out) {
  for (int64_t s = 0; s < d.S; ++s) {
    std::memcpy(out + s * H, x + ((b * d.S + s) * d.K + kh) * H, H * sizeof(float));
  }
  std::fill(out + d.S * H, out + Sp * H, 0.0f);
}

// dots[r][j] = sum_h a[r][h] * bt[j / kW][h][j % kW] for rows r < R and the NB blocks of keys
// j in [j, j + NB kW) (bt packed by `PackTransposed`).
template <int H, int R, int NB>
inline void RowDotsBlocks(const float (&a)[R][H], const float* bt, int64_t j, float* dots,
                          int64_t ld) {
  constexpr int NV = kW / kL;  // wide vectors of keys per block
  static_assert(NV * kL == kW, "whole vectors of keys per block");
  constexpr int NC = NB * NV;
  const float* block = bt + (j / kW) * H * kW;
  vw acc[R][NC];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = Splat<vw>(0.0f);
  for (int h = 0; h < H; ++h) {
    vw keys[NC];
    for (int c = 0; c < NC; ++c)
      keys[c] = LoadShared<R, vw>(block + (c / NV) * H * kW + h * kW + (c % NV) * kL);
    for (int r = 0; r < R; ++r) {
      const vw av = Splat<vw>(a[r][h]);
      for (int c = 0; c < NC; ++c) acc[r][c] += av * keys[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NC; ++c) Store(dots + r * ld + j + c * kL, acc[r][c]);
}

// Accumulators a product may keep in registers: 16 of AVX-512's 32 vector registers, 8 of AVX2's
// 16 (the rest hold the operands). Eight sums in flight hide the FMA's latency; with 16, blocks of
// eight query rows read each key's vectors for twice the FMAs.
constexpr int kAccumulators = kL == 16 ? 16 : 8;

// Blocks of keys per pass of RowDots: eight sums in flight, or two blocks for a block of eight
// rows (16 sums, each row's broadcast read for two FMAs); each dot's sum over h runs in the same
// order whatever the number.
template <int R>
constexpr int BlocksPerPass() {
  constexpr int sums = R * (kW / kL), target = R == 8 ? 16 : 8;
  return sums >= target ? 1 : target / sums;
}

// RowDots' passes of NB blocks from key j while whole ones fit below RoundUp(j1, kW), then of
// NB / 2, ...; returns where they stopped.
template <int H, int R, int NB>
inline int64_t RowDotsPasses(const float (&a)[R][H], const float* bt, int64_t j, int64_t j1,
                             float* dots, int64_t ld) {
  for (; j + (NB - 1) * kW < j1; j += NB * kW) RowDotsBlocks<H, R, NB>(a, bt, j, dots, ld);
  if constexpr (NB > 1) j = RowDotsPasses<H, R, NB / 2>(a, bt, j, j1, dots, ld);
  return j;
}

// dots[r][j] = sum_h a[r][h] * bt[j / kW][h][j % kW] for rows r < R and keys j in
// [j0, RoundUp(j1, kW)) (j0 a multiple of kW; bt packed by `PackTransposed`).
template <int H, int R>
inline void RowDots(const float (&a)[R][H], const float* bt, int64_t j0, int64_t j1, float* dots,
                    int64_t ld) {
  constexpr int NB = BlocksPerPass<R>();
  static_assert((NB & (NB - 1)) == 0, "halving passes end at one block");
  RowDotsPasses<H, R, NB>(a, bt, j0, j1, dots, ld);
}

// Vectors of a row's C per pass of `WeightedRows` and `AccumulateRows`: R * CB row or accumulator
// vectors stay in registers (at most kAccumulators, the rest for the key's vectors).
template <int C, int R>
constexpr int ColumnBlock() {
  return R * C <= kAccumulators ? C : kAccumulators / R;
}

// The vector a head's row of H floats is read in: the wide one where it divides H.
template <int H>
using RowVector = std::conditional_t<H % kL == 0, vw, vf>;

// out[r][:] = sum_{j in [j0, j1)} w[r][j] * x[j][:] for r < R (x [Sp, H] contiguous), in passes
// of ColumnBlock vectors of the row (each element's sum in the same order whatever the passes).
template <int H, int R>
inline void WeightedRows(const float* w, int64_t ld, int64_t j0, int64_t j1, const float* x,
                         float (&out)[R][H]) {
  using V = RowVector<H>;
  constexpr int LV = Lanes<V>();
  constexpr int C = H / LV;  // vectors per row
  constexpr int CB = ColumnBlock<C, R>();
  static_assert(C * LV == H && C % CB == 0, "whole vectors, whole passes");
  for (int c0 = 0; c0 < C; c0 += CB) {
    V acc[R][CB];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CB; ++c) acc[r][c] = Splat<V>(0.0f);
    for (int64_t j = j0; j < j1; ++j) {
      V xr[CB];
      for (int c = 0; c < CB; ++c) xr[c] = LoadShared<R, V>(x + j * H + (c0 + c) * LV);
      for (int r = 0; r < R; ++r) {
        const V wv = Splat<V>(w[r * ld + j]);
        for (int c = 0; c < CB; ++c) acc[r][c] += wv * xr[c];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CB; ++c) Store(&out[r][(c0 + c) * LV], acc[r][c]);
  }
}

// dk[j][:] += sum_r ds[r][j] qs[r][:] and dv[j][:] += sum_r p[r][j] do[r][:], j in [j0, j1):
// one pass for each, so that a pass's row vectors and its accumulators stay in registers.
template <int H, int R>
inline void AccumulateRows(const float* w, int64_t ld, int64_t j0, int64_t j1,
                           const float (&rows)[R][H], float* acc) {
  using V = RowVector<H>;
  constexpr int LV = Lanes<V>();
  constexpr int C = H / LV;
  constexpr int CB = ColumnBlock<C, R>();
  static_assert(C * LV == H && C % CB == 0, "whole vectors, whole passes");
  for (int c0 = 0; c0 < C; c0 += CB) {
    V rv[R][CB];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < CB; ++c) rv[r][c] = Load<V>(&rows[r][(c0 + c) * LV]);
    for (int64_t j = j0; j < j1; ++j) {
      V aj[CB];
      for (int c = 0; c < CB; ++c) aj[c] = Load<V>(acc + j * H + (c0 + c) * LV);
      for (int r = 0; r < R; ++r) {
        const V wv = Splat<V>(w[r * ld + j]);
        for (int c = 0; c < CB; ++c) aj[c] += wv * rv[r][c];
      }
      for (int c = 0; c < CB; ++c) Store(acc + j * H + (c0 + c) * LV, aj[c]);
    }
  }
}

template <int H, int R>
inline void KeyGrads(const float* ds, const float* p, int64_t ld, int64_t j0, int64_t j1,
                     const float (&qs)[R][H], const float (&dout)[R][H], float* dk, float* dv) {
  AccumulateRows<H, R>(ds, ld, j0, j1, qs, dk);
  AccumulateRows<H, R>(p, ld, j0, j1, dout, dv);
}

// Query rows per block: each packed key vector is read once for every row's FMAs, and the
// accumulators stay in registers (`ColumnBlock` splits a wide head's row into passes). Four rows
// at every head dim (heads of 64 and 128 took one row before, and ran 2.3-2.7x slower); eight
// for heads of 32 and more where there are 32 vector registers (docs/benchmarks.md, "Eight query
// rows per block").
template <int H>
constexpr int RowsPerBlock() {
  return kAccumulators == 16 && H >= 32 ? 8 : 4;
}

// Runs block(rows, t0) over the T query rows: blocks of R rows (rows a std::integral_constant),
// then of four where R is eight, then the last rows one at a time. No block holds padding rows,
// whose +0 terms would turn a key gradient's -0 into +0, so the results do not depend on the
// blocking (a decoding step's single query runs alone, as it would in a longer chunk's last rows).
template <int R, typename Fn>
inline void ForEachRowBlock(int64_t T, const Fn& block, int64_t t0 = 0) {
  for (; t0 + R <= T; t0 += R) block(std::integral_constant<int, R>{}, t0);
  if constexpr (R > 4) {
    ForEachRowBlock<4>(T, block, t0);
  } else {
    for (; t0 < T; ++t0) block(std::integral_constant<int, 1>{}, t0);
  }
}

// A row block: its rows' key ranges and the span [a, e) of keys any of them sees, widened to
// whole vf vectors [a8, e8) for the products with the keys' rows, and to whole wide vectors
// [aL, eL) for the softmax passes (keys outside a row's range are masked there; the products of
// the logits, `RowDots`, cover whole blocks of kW keys, so the logits cover [aL, eL)).
template <int R>
struct Block {
  int rows;
  int64_t lo[R], hi[R], a, e, a8, e8, aL, eL;
};

template <int R>
Block<R> MakeBlock(const Dims& d, int64_t t0) {
  Block<R> blk;
  // Every block `ForEachRowBlock` makes is full (rows == R), but the passes loop to `rows` at run
  // time: bounded by the constant R instead, the tiny shape's forward + backward measured 4-12%
  // slower (docs/benchmarks.md, "Four query rows per block at every head dim"). A block that were
  // not full would have padding rows that see no key.
  blk.rows = static_cast<int>(std::min<int64_t>(R, d.T - t0));
  // The span in scalars as the ranges are made: a vectorised min/max that read them back from
  // blk.lo and blk.hi waited on their stores (a store forwarding stall: 13% of the small shape's
  // forward on the Xeon of docs/benchmarks.md, "a stall in the kernel's row blocks").
  int64_t a = 0, e = 0;
  for (int r = 0; r < R; ++r) {
    int64_t lo, hi;
    KeyRange(d, t0 + std::min(r, blk.rows - 1), &lo, &hi);
    if (r >= blk.rows) hi = lo;  // padding rows see nothing
    blk.lo[r] = lo, blk.hi[r] = hi;
    if (r < blk.rows) {  // row 0 always is
      a = r == 0 ? lo : std::min(a, lo);
      e = r == 0 ? hi : std::max(e, hi);
    }
  }
  blk.a = a, blk.e = e;
  blk.a8 = blk.a / kV * kV;
  blk.e8 = RoundUp(blk.e, kV);
  blk.aL = blk.a / kL * kL;
  blk.eL = RoundUp(blk.e, kL);
  return blk;
}

// Soft-capping (Gemma 2) of a row of content logits over [aL, eL), in place: s = c tanh(s / c)
// with tanh(x) = 1 - 2 / (exp(2x) + 1) (Exp saturates, so |s| large gives +-c), and, when `slope`
// is given, its derivative 1 - tanh^2 there. The row's products are finite over [aL, eL).
template <int R>
inline void Cap(const Block<R>& blk, float c, float* sr, float* slope) {
  const float twice_inv = 2.0f / c;
  for (int64_t j = blk.aL; j < blk.eL; j += kL) {
    const vw t = 1.0f - 2.0f / (Exp(Load<vw>(sr + j) * twice_inv) + 1.0f);
    Store(sr + j, t * c);
    if (slope) Store(slope + j, 1.0f - t * t);
  }
}

// The 0 < n < kL floats at p, zero padded to a wide vector.
inline vw LoadTail(const float* p, int64_t n) {
  float tail[kL] = {};
  std::memcpy(tail, p, n * sizeof(float));
  return Load<vw>(tail);
}

// Row r of the logits `sr` (scaled products, over [aL, eL)), plus its bias row `br` (S keys)
// when kBias, -inf outside the row's key range, in place. One pass of whole vectors, each read
// as RowDots stored it; a bias vector that would run past the row's S keys is read zero padded.
template <bool kBias, int R>
inline void BiasAndMask(const Block<R>& blk, int r, const float* br, int64_t S, float* sr) {
  const int32_t lo = static_cast<int32_t>(blk.lo[r]), hi = static_cast<int32_t>(blk.hi[r]);
  auto idx = Iota<vw>(static_cast<int32_t>(blk.aL));
  for (int64_t j = blk.aL; j < blk.eL; j += kL, idx += kL) {
    vw x = Load<vw>(sr + j);
    if constexpr (kBias) {
      x += j + kL <= S ? Load<vw>(br + j) : LoadTail(br + j, S - j);
    } else {
      // x opaque, so that the store below writes the whole vector: GCC would otherwise store
      // only the hidden keys' lanes (an AVX-512 masked store), and on the Xeon measured the
      // next pass's loads of those vectors waited for it (docs/benchmarks.md, "The logit bias
      // in the native kernel").
      Opaque(x);
    }
    Store(sr + j, (idx >= lo) & (idx < hi) ? x : Splat<vw>(kNegInf));
  }
}

// BiasAndMask with the bias row of block row r when there is one.
template <int R>
inline void BiasAndMask(const Block<R>& blk, int r, const float* bias, const Dims& d, int64_t t0,
                        float* sr) {
  if (bias && r < blk.rows) {
    BiasAndMask<true>(blk, r, bias + (t0 + r) * d.S, d.S, sr);
  } else {
    BiasAndMask<false>(blk, r, nullptr, d.S, sr);
  }
}

template <int H, typename Pool>
void Forward(Pool& pool, const Dims& d, const float* q, const float* k, const float* v,
             const float* bias, float* out, float* m_out, float* inv_l_out) {
  const int64_t Sp = RoundUp(std::max<int64_t>(d.S, 1), kW);
  // Items in head-major order: the two threads' items at any moment are mostly one head's
  // (the forward alone up to 1.09x faster than batch-major at the training shapes on the Xeon
  // of docs/benchmarks.md, "The kernel's items by head"; the same bits).
  ParallelFor(pool, d.B * d.K, [&](int64_t item) {
    const int64_t kh = item / d.B, b = item % d.B;
    float* kt = Scratch(0, H * Sp);
    float* vr = Scratch(1, Sp * H);
    float* s = Scratch(2, RowsPerBlock<H>() * Sp);
    PackTransposed<H>(d, k, b, kh, Sp, kt);
    PackRows<H>(d, v, b, kh, Sp, vr);
    for (int64_t g = 0; g < d.G; ++g) {
      const int64_t n = kh * d.G + g;
      const float* bs = BiasSlice(d, bias, b, n);
      ForEachRowBlock<RowsPerBlock<H>()>(d.T, [&](auto rows, int64_t t0) {
        constexpr int R = decltype(rows)::value;
        const Block<R> blk = MakeBlock<R>(d, t0);
        float qa[R][H] = {};
        for (int r = 0; r < blk.rows; ++r) {
          const float* qr = q + ((b * d.T + t0 + r) * d.N + n) * H;
          for (int h = 0; h < H; ++h) qa[r][h] = qr[h] * d.scale;
        }
        float inv_l[R], mrow[R];
        if (blk.e > blk.a) RowDots<H, R>(qa, kt, blk.a / kW * kW, blk.e, s, Sp);
        for (int r = 0; r < R; ++r) {
          float* sr = s + r * Sp;
          if (d.softcap > 0.0f) Cap(blk, d.softcap, sr, nullptr);
          BiasAndMask(blk, r, bs, d, t0, sr);
          vf vmax = Splat(kNegInf);
          for (int64_t j = blk.aL; j < blk.eL; j += kL) MaxInOrder(vmax, Load<vw>(sr + j));
          const float mx = HorizontalMax(vmax);
          const float m = mx == kNegInf ? 0.0f : mx;  // a row that sees no key
          vf vsum = Splat(0.0f);
          for (int64_t j = blk.aL; j < blk.eL; j += kL) {
            const vw p = Exp(Load<vw>(sr + j) - m);
            Store(sr + j, p);
            AddInOrder(vsum, p);
          }
          const float l = HorizontalSum(vsum);
          mrow[r] = m;
          inv_l[r] = 1.0f / (l > 0.0f ? l : 1.0f);
        }
        float o[R][H];
        WeightedRows<H, R>(s, Sp, blk.a8, blk.e8, vr, o);
        for (int r = 0; r < blk.rows; ++r) {
          const int64_t t = t0 + r;
          float* orow = out + ((b * d.T + t) * d.N + n) * H;
          for (int h = 0; h < H; ++h) orow[h] = o[r][h] * inv_l[r];
          m_out[(b * d.N + n) * d.T + t] = mrow[r];
          inv_l_out[(b * d.N + n) * d.T + t] = inv_l[r];
        }
      });
    }
  });
}

template <int H, typename Pool>
void Backward(Pool& pool, const Dims& d, bool bias_grad, const float* q,
              const float* k, const float* v, const float* bias, const float* d_out,
              const float* m_in, const float* inv_l_in, float* dq, float* dk, float* dv,
              float* d_bias) {
  const int64_t Sp = RoundUp(std::max<int64_t>(d.S, 1), kW);
  // An item owns (a set of batch rows) x (a set of key/value heads): every (b, kh) when the
  // bias gradient is not shared; all b of a head group when it is shared by the batch rows; all
  // heads when it is shared by the heads. It visits them in order, so sums are deterministic.
  const bool share_b = bias_grad && d.Bb == 1 && d.B > 1;
  const bool share_n = bias_grad && d.Nb == 1 && d.N > 1;
  const int64_t items_b = share_b ? 1 : d.B, items_k = share_n ? 1 : d.K;
  if (bias_grad) std::fill(d_bias, d_bias + d.Bb * d.Nb * d.T * d.S, 0.0f);
  ParallelFor(pool, items_b * items_k, [&](int64_t item) {
    const int64_t ik = item / items_b, ib = item % items_b;  // head-major, as the forward's
    const int64_t b_begin = share_b ? 0 : ib, b_end = share_b ? d.B : ib + 1;
    const int64_t k_begin = share_n ? 0 : ik, k_end = share_n ? d.K : ik + 1;
    float* kt = Scratch(0, H * Sp);
    float* vt = Scratch(1, H * Sp);
    float* kr = Scratch(2, Sp * H);
    float* dk_acc = Scratch(3, Sp * H);
    float* dv_acc = Scratch(4, Sp * H);
    float* p = Scratch(5, RowsPerBlock<H>() * Sp);
    float* ds = Scratch(6, RowsPerBlock<H>() * Sp);
    float* dp = Scratch(7, RowsPerBlock<H>() * Sp);
    float* slope = d.softcap > 0.0f ? Scratch(8, RowsPerBlock<H>() * Sp) : nullptr;
    for (int64_t b = b_begin; b < b_end; ++b) {
      for (int64_t kh = k_begin; kh < k_end; ++kh) {
        PackTransposed<H>(d, k, b, kh, Sp, kt);
        PackTransposed<H>(d, v, b, kh, Sp, vt);
        PackRows<H>(d, k, b, kh, Sp, kr);
        std::fill(dk_acc, dk_acc + Sp * H, 0.0f);
        std::fill(dv_acc, dv_acc + Sp * H, 0.0f);
        for (int64_t g = 0; g < d.G; ++g) {
          const int64_t n = kh * d.G + g;
          const float* bs = BiasSlice(d, bias, b, n);
          float* dbs = bias_grad ? const_cast<float*>(BiasSlice(d, d_bias, b, n)) : nullptr;
          ForEachRowBlock<RowsPerBlock<H>()>(d.T, [&](auto rows, int64_t t0) {
            constexpr int R = decltype(rows)::value;
            const Block<R> blk = MakeBlock<R>(d, t0);
            if (blk.e <= blk.a) {  // no row of the block sees a key: dq is 0
              for (int r = 0; r < blk.rows; ++r) {
                std::fill_n(dq + ((b * d.T + t0 + r) * d.N + n) * H, H, 0.0f);
              }
              return;
            }
            float qs[R][H] = {}, doa[R][H] = {};
            float mrow[R] = {}, il[R] = {};
            for (int r = 0; r < blk.rows; ++r) {
              const int64_t t = t0 + r;
              const float* qr = q + ((b * d.T + t) * d.N + n) * H;
              const float* dr = d_out + ((b * d.T + t) * d.N + n) * H;
              for (int h = 0; h < H; ++h) {
                qs[r][h] = qr[h] * d.scale;
                doa[r][h] = dr[h];
              }
              mrow[r] = m_in[(b * d.N + n) * d.T + t];
              il[r] = inv_l_in[(b * d.N + n) * d.T + t];
            }
            const int64_t a16 = blk.a / kW * kW;
            RowDots<H, R>(qs, kt, a16, blk.e, p, Sp);
            RowDots<H, R>(doa, vt, a16, blk.e, dp, Sp);
            for (int r = 0; r < R; ++r) {
              float* pr = p + r * Sp;
              const float* dpr = dp + r * Sp;
              float* dsr = ds + r * Sp;
              float* slr = slope ? slope + r * Sp : nullptr;
              if (slr) Cap(blk, d.softcap, pr, slr);
              BiasAndMask(blk, r, bs, d, t0, pr);
              const float m = mrow[r], inv_l = il[r];
              vf vdelta = Splat(0.0f);
              for (int64_t j = blk.aL; j < blk.eL; j += kL) {
                const vw pj = Exp(Load<vw>(pr + j) - m) * inv_l;
                Store(pr + j, pj);
                AddProductInOrder(vdelta, pj, Load<vw>(dpr + j));
              }
              const float delta = HorizontalSum(vdelta);
              for (int64_t j = blk.aL; j < blk.eL; j += kL) {
                Store(dsr + j, Load<vw>(pr + j) * (Load<vw>(dpr + j) - delta));
              }
              if (dbs && r < blk.rows) {  // ds is +-0 at the hidden keys of [a8, e8)
                float* dbr = dbs + (t0 + r) * d.S;
                const int64_t full = std::min(blk.e8, d.S / kV * kV);
                int64_t j = blk.a8;
                for (; j < full; j += kV) Store(dbr + j, Load(dbr + j) + Load(dsr + j));
                for (; j < blk.e; ++j) dbr[j] += dsr[j];
              }
              if (slr) {  // dq and dk see the content logits through the cap
                for (int64_t j = blk.aL; j < blk.eL; j += kL) {
                  Store(dsr + j, Load<vw>(dsr + j) * Load<vw>(slr + j));
                }
              }
            }
            float dqa[R][H];  // dq = scale ds k
            WeightedRows<H, R>(ds, Sp, blk.a8, blk.e8, kr, dqa);
            for (int r = 0; r < blk.rows; ++r) {
              float* dqr = dq + ((b * d.T + t0 + r) * d.N + n) * H;
              for (int h = 0; h < H; ++h) dqr[h] = dqa[r][h] * d.scale;
            }
            // dk += scale ds^T q (qs holds scale q), dv += p^T dO
            KeyGrads<H, R>(ds, p, Sp, blk.a8, blk.e8, qs, doa, dk_acc, dv_acc);
          });
        }
        for (int64_t s = 0; s < d.S; ++s) {
          std::memcpy(dk + ((b * d.S + s) * d.K + kh) * H, dk_acc + s * H, H * sizeof(float));
          std::memcpy(dv + ((b * d.S + s) * d.K + kh) * H, dv_acc + s * H, H * sizeof(float));
        }
      }
    }
  });
}

ffi::Error MakeDims(ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k, ffi::Buffer<ffi::F32>& v,
                    ffi::Buffer<ffi::F32>& bias, float scale, float softcap, int64_t causal,
                    int64_t offset, int64_t window, Dims* d) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), bd = bias.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4) {
    return ffi::Error::InvalidArgument("posattn native attention: q, k, v must be 4-D");
  }
  d->B = qd[0], d->T = qd[1], d->N = qd[2], d->H = qd[3];
  d->S = kd[1], d->K = kd[2];
  if (kd[0] != d->B || kd[3] != d->H || vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2] ||
      vd[3] != kd[3] || d->K == 0 || d->N % d->K != 0) {
    return ffi::Error::InvalidArgument("posattn native attention: inconsistent q, k, v shapes");
  }
  d->G = d->N / d->K;
  d->has_bias = bias.element_count() > 0;
  d->Bb = d->Nb = 1;
  if (d->has_bias) {
    if (bd.size() != 4 || !(bd[0] == 1 || bd[0] == d->B) || !(bd[1] == 1 || bd[1] == d->N) ||
        bd[2] != d->T || bd[3] != d->S) {
      return ffi::Error::InvalidArgument(
          "posattn native attention: the bias must be [B or 1, N or 1, T, S]");
    }
    d->Bb = bd[0], d->Nb = bd[1];
  }
  d->scale = scale;
  d->softcap = softcap;
  d->causal = causal != 0;
  d->offset = offset;
  d->window = window;
  return ffi::Error::Success();
}

#define POSATTN_DISPATCH_H(H_VALUE, CALL)                                                  \
  switch (H_VALUE) {                                                                       \
    case 8: { constexpr int H = 8; CALL; break; }                                          \
    case 16: { constexpr int H = 16; CALL; break; }                                        \
    case 32: { constexpr int H = 32; CALL; break; }                                        \
    case 64: { constexpr int H = 64; CALL; break; }                                        \
    case 128: { constexpr int H = 128; CALL; break; }                                      \
    default:                                                                               \
      return ffi::Error::InvalidArgument("posattn native attention: head dim not in "      \
                                         "{8, 16, 32, 64, 128}");                          \
  }

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> bias, float scale,
                       float softcap, int64_t causal, int64_t offset, int64_t window,
                       ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> m,
                       ffi::ResultBuffer<ffi::F32> inv_l) {
  Dims d;
  if (auto err = MakeDims(q, k, v, bias, scale, softcap, causal, offset, window, &d);
      err.failure()) {
    return err;
  }
  POSATTN_DISPATCH_H(d.H, Forward<H>(pool, d, q.typed_data(), k.typed_data(), v.typed_data(),
                                     bias.typed_data(), out->typed_data(), m->typed_data(),
                                     inv_l->typed_data()));
  return ffi::Error::Success();
}

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> bias,
                        ffi::Buffer<ffi::F32> d_out, ffi::Buffer<ffi::F32> m,
                        ffi::Buffer<ffi::F32> inv_l, float scale, float softcap, int64_t causal,
                        int64_t offset, int64_t window, int64_t bias_grad,
                        ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                        ffi::ResultBuffer<ffi::F32> dv, ffi::ResultBuffer<ffi::F32> d_bias) {
  Dims d;
  if (auto err = MakeDims(q, k, v, bias, scale, softcap, causal, offset, window, &d);
      err.failure()) {
    return err;
  }
  const bool grad = bias_grad != 0 && d.has_bias;
  POSATTN_DISPATCH_H(d.H, Backward<H>(pool, d, grad, q.typed_data(), k.typed_data(),
                                      v.typed_data(), bias.typed_data(), d_out.typed_data(),
                                      m.typed_data(), inv_l.typed_data(), dq->typed_data(),
                                      dk->typed_data(), dv->typed_data(), d_bias->typed_data()));
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// The weight gradient of a dense layer, dW = X^T dY: X [M, A], dY [M, B] -> dW [A, B], the sum
// over the M rows (posattn/nn/layers.py's `_matmul` on CPU). XLA:CPU runs this product (both
// operands contracted over their rows) through Eigen. Here the output is cut into tiles of
// kGradRows rows of A x kGradCols columns of B; an item owns a run of column stripes (or, where
// there are fewer stripes than threads, a stripe's run of tiles) and, for each chunk of
// kGradChunk rows, packs its tiles of X once and each stripe of dY contiguously (zero-padded at
// the edges), so that a tile's accumulators stay in registers over the chunk and its operands in
// L1. Each output element is a sum of FMAs over one chunk's rows in order, added to the sum of
// the chunks before it in order: the same bits for any number of threads or vector width.
constexpr int kGradRows = 6;
// Four wide vectors a row where there are 32 vector registers (AVX-512: 24 accumulators, 4
// loads, a broadcast), two where there are 16.
constexpr int kGradCols = (kL == 16 ? 4 : 2) * kL;
constexpr int64_t kGradChunk = 128;

template <typename V>
void GradientTiles(const float* x, const float* dy, float* dw, int64_t M, int64_t A, int64_t B,
                   int64_t s_lo, int64_t s_hi, int64_t t_lo, int64_t t_hi) {
  constexpr int C = kGradCols / Lanes<V>();  // accumulators a row
  float* dy_p = Scratch(0, kGradChunk * kGradCols);
  float* x_p = Scratch(1, (t_hi - t_lo) * kGradChunk * kGradRows);
  const int64_t full_tiles = std::min(t_hi, A / kGradRows);
  for (int64_t k0 = 0; k0 < M; k0 += kGradChunk) {
    const int64_t kn = std::min(kGradChunk, M - k0);
    // The chunk's rows of the item's tiles of x, [tile][row][kGradRows], once for all its stripes
    // (whole tiles by copies of a constant size, the edge zero-padded).
    for (int64_t k = 0; k < kn; ++k) {
      const float* xr = x + (k0 + k) * A;
      for (int64_t t = t_lo; t < t_hi; ++t) {
        float* xt = x_p + ((t - t_lo) * kGradChunk + k) * kGradRows;
        const int64_t a0 = t * kGradRows;
        if (t < full_tiles) {
          std::memcpy(xt, xr + a0, kGradRows * sizeof(float));
        } else {
          std::copy(xr + a0, xr + A, xt);
          std::fill(xt + (A - a0), xt + kGradRows, 0.0f);
        }
      }
    }
    for (int64_t s = s_lo; s < s_hi; ++s) {
      const int64_t b0 = s * kGradCols;
      const int64_t width = std::min<int64_t>(kGradCols, B - b0);
      for (int64_t k = 0; k < kn; ++k) {  // the chunk's rows of the stripe of dy, [row][kGradCols]
        float* row = dy_p + k * kGradCols;
        const float* dy_row = dy + (k0 + k) * B + b0;
        if (width == kGradCols) {
          std::memcpy(row, dy_row, kGradCols * sizeof(float));
        } else {
          std::copy(dy_row, dy_row + width, row);
          std::fill(row + width, row + kGradCols, 0.0f);
        }
      }
      for (int64_t t = t_lo; t < t_hi; ++t) {
        const float* xt = x_p + (t - t_lo) * kGradChunk * kGradRows;
        V acc[kGradRows][C];
        for (int r = 0; r < kGradRows; ++r)
          for (int c = 0; c < C; ++c) acc[r][c] = V{};
        for (int64_t k = 0; k < kn; ++k) {
          V d[C];
          for (int c = 0; c < C; ++c) d[c] = Load<V>(dy_p + k * kGradCols + c * Lanes<V>());
          for (int r = 0; r < kGradRows; ++r) {
            const float a = xt[k * kGradRows + r];
            for (int c = 0; c < C; ++c) acc[r][c] += a * d[c];
          }
        }
        const int64_t a0 = t * kGradRows, rows = std::min<int64_t>(kGradRows, A - a0);
        for (int64_t r = 0; r < rows; ++r) {
          float* out = dw + (a0 + r) * B + b0;
          if (width == kGradCols) {
            for (int c = 0; c < C; ++c) {
              V sum = acc[r][c];
              if (k0 > 0) sum += Load<V>(out + c * Lanes<V>());
              Store(out + c * Lanes<V>(), sum);
            }
          } else {
            float tile[kGradCols];
            for (int c = 0; c < C; ++c) Store(tile + c * Lanes<V>(), acc[r][c]);
            for (int64_t j = 0; j < width; ++j) out[j] = k0 > 0 ? out[j] + tile[j] : tile[j];
          }
        }
      }
    }
  }
}

ffi::Error WeightGradientImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::F32> dy, ffi::ResultBuffer<ffi::F32> dw) {
  const auto xd = x.dimensions(), yd = dy.dimensions();
  if (xd.size() != 2 || yd.size() != 2 || xd[0] != yd[0]) {
    return ffi::Error::InvalidArgument(
        "posattn weight gradient: x and dy must be [M, A] and [M, B] with the same M");
  }
  const int64_t M = xd[0], A = xd[1], B = yd[1];
  float* out = dw->typed_data();
  if (M == 0) {
    std::fill(out, out + A * B, 0.0f);
    return ffi::Error::Success();
  }
  const int64_t stripes = (B + kGradCols - 1) / kGradCols;
  const int64_t tiles = (A + kGradRows - 1) / kGradRows;
  // One item a thread: a run of whole stripes (x's tiles packed once a chunk for all of them),
  // or, where there are fewer stripes than threads, a stripe's run of tiles.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t groups = std::min(stripes, threads);
  const int64_t parts = std::min(tiles, std::max<int64_t>(1, threads / groups));
  const int64_t s_per = (stripes + groups - 1) / groups, t_per = (tiles + parts - 1) / parts;
  ParallelFor(pool, groups * parts, [&](int64_t item) {
    const int64_t s_lo = item / parts * s_per, s_hi = std::min(stripes, s_lo + s_per);
    const int64_t t_lo = item % parts * t_per, t_hi = std::min(tiles, t_lo + t_per);
    if (s_lo < s_hi && t_lo < t_hi) {
      GradientTiles<vw>(x.typed_data(), dy.typed_data(), out, M, A, B, s_lo, s_hi, t_lo, t_hi);
    }
  });
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// A dense layer's product y = x w (or x w^T): x [M, K], w [K, N] (transposed: [N, K]) -> y [M, N]
// (posattn/nn/layers.py's `_matmul` on CPU: its forward, and dx = dy w^T). w is packed once a
// call into stripes of kGradCols columns, [stripe][K][kGradCols] (zero-padded past N); an item
// owns kProductRows rows of y and runs them in tiles of kGradRows rows x one stripe, whose
// accumulators stay in registers over all K terms. Each element is one FMA a term in order from
// 0: the same bits for any number of threads or vector width (and, at the training shapes on
// the AMX Xeon of docs/benchmarks.md, the same bits as XLA:CPU's own product).
constexpr int64_t kProductRows = 96;

template <int R, typename V>
inline void ProductTile(const float* x, int64_t K, int64_t m0, const float* stripe, float* y,
                        int64_t N, int64_t n0) {
  constexpr int C = kGradCols / Lanes<V>();
  V acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = V{};
  const float* xr = x + m0 * K;
  for (int64_t k = 0; k < K; ++k) {
    V w[C];
    for (int c = 0; c < C; ++c) w[c] = Load<V>(stripe + k * kGradCols + c * Lanes<V>());
    for (int r = 0; r < R; ++r) {
      const V a = Splat<V>(xr[r * K + k]);
      for (int c = 0; c < C; ++c) acc[r][c] += a * w[c];
    }
  }
  const int64_t width = std::min<int64_t>(kGradCols, N - n0);
  for (int r = 0; r < R; ++r) {
    float* out = y + (m0 + r) * N + n0;
    if (width == kGradCols) {
      for (int c = 0; c < C; ++c) Store(out + c * Lanes<V>(), acc[r][c]);
    } else {
      float tile[kGradCols];
      for (int c = 0; c < C; ++c) Store(tile + c * Lanes<V>(), acc[r][c]);
      std::copy(tile, tile + width, out);
    }
  }
}

ffi::Error ProductImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       int64_t transposed, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  const int64_t M = xd.size() == 2 ? xd[0] : -1, K = xd.size() == 2 ? xd[1] : -1;
  const int64_t wk = wd.size() == 2 ? wd[transposed ? 1 : 0] : -2;
  if (M < 0 || wk != K) {
    return ffi::Error::InvalidArgument(
        "posattn product: x must be [M, K] and w [K, N] (transposed: [N, K])");
  }
  const int64_t N = wd[transposed ? 0 : 1];
  float* out = y->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(out, out + M * N, 0.0f);
    return ffi::Error::Success();
  }
  const int64_t stripes = (N + kGradCols - 1) / kGradCols;
  float* packed = Scratch(0, stripes * K * kGradCols);  // the caller's, read by every item
  const float* wv = w.typed_data();
  for (int64_t s = 0; s < stripes; ++s) {
    for (int64_t k = 0; k < K; ++k) {
      float* row = packed + (s * K + k) * kGradCols;
      for (int64_t j = 0; j < kGradCols; ++j) {
        const int64_t n = s * kGradCols + j;
        row[j] = n >= N ? 0.0f : transposed ? wv[n * K + k] : wv[k * N + n];
      }
    }
  }
  const float* xv = x.typed_data();
  ParallelFor(pool, (M + kProductRows - 1) / kProductRows, [&](int64_t item) {
    const int64_t m_lo = item * kProductRows, m_hi = std::min(M, m_lo + kProductRows);
    for (int64_t s = 0; s < stripes; ++s) {
      const float* stripe = packed + s * K * kGradCols;
      int64_t m0 = m_lo;
      for (; m0 + kGradRows <= m_hi; m0 += kGradRows) {
        ProductTile<kGradRows, vw>(xv, K, m0, stripe, out, N, s * kGradCols);
      }
      for (; m0 < m_hi; ++m0) ProductTile<1, vw>(xv, K, m0, stripe, out, N, s * kGradCols);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PosattnAttentionForward, ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias (empty: none)
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("causal")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("window")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // m
                                  .Ret<ffi::Buffer<ffi::F32>>()  // inv_l
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(PosattnAttentionBackward, BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias (empty: none)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // d_out
                                  .Arg<ffi::Buffer<ffi::F32>>()  // m
                                  .Arg<ffi::Buffer<ffi::F32>>()  // inv_l
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("causal")
                                  .Attr<int64_t>("offset")
                                  .Attr<int64_t>("window")
                                  .Attr<int64_t>("bias_grad")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dq
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dk
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dv
                                  .Ret<ffi::Buffer<ffi::F32>>()  // d_bias
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(PosattnWeightGradient, WeightGradientImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, A]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dy [M, B]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dw [A, B]
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(PosattnProduct, ProductImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [K, N] (transposed: [N, K])
                                  .Attr<int64_t>("transposed")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [M, N]
);
