// A few-row integer dot for XLA:CPU: out[b, m, n] = sum_k a[b, m, k] w[b, n, k]
// with int8 activations a, int8 or packed int4 weights w, int32 results
// that wrap modulo 2^32 as XLA's int32 dot does (integer sums: the same
// bits as XLA's dot, in any order).
//
// Why: XLA:CPU runs an int8 dot of one to sixteen activation rows well
// below memory bandwidth (and has no int4 dot at all: it widens int4 codes
// to int8 first), so int8 decoding at batch 1 read weights at ~15 GB/s
// where float32 reads them at ~30. This kernel streams each weight row once
// and dots it with every activation row, which reaches memory bandwidth at
// one or two rows. Two forms, chosen when aqtr builds it for the host:
// AVX-512 VNNI (`vpdpbusd`, 64 bytes a step) and AVX2 (`vpmaddwd` on codes
// widened to int16, 32 bytes a step).
//
// vpdpbusd multiplies unsigned by signed bytes:
//   int8 weights:  sum (a + 128) w - 128 sum w   (a + 128 is a's bits ^ 0x80)
//   int4 weights:  sum (u + 8) a - 8 sum a       (u: the nibble, signed;
//                  u + 8 in [0, 15] is the nibble's bits ^ 0x8)
// XLA:CPU stores an s4 array packed, two elements a byte, the even element
// in the low nibble; the int4 path reads the low and high nibbles of a row
// against the even and odd activations. aqtr checks both paths against
// XLA's own dot once per process before using them (`native_dot.py`).
//
// Built by aqtr on first use with the host's compiler (see native_dot.py);
// registered as the XLA FFI target "aqtr_int_rows_dot" for CPU.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxRows = 8;  // Activation rows per pass over a weight.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

constexpr int64_t kLane = 64;  // Weight bytes a step: an AVX-512 register.
using Int8Act = uint8_t;  // a ^ 0x80: a + 128.
using Int4Act = int8_t;
inline Int8Act Int8ActOf(int8_t a) { return uint8_t(a) ^ 0x80u; }

// A row of `bytes` bytes as `count` 64-byte loads, the last one masked
// (zeros past the row's end).
struct Steps {
  explicit Steps(int64_t bytes)
      : full(bytes / kLane),
        count((bytes + kLane - 1) / kLane),
        tail(bytes % kLane ? (~__mmask64(0)) >> (kLane - bytes % kLane) : 0) {}
  __m512i Load(const void* row, int64_t i) const {
    const char* p = static_cast<const char*>(row) + i * kLane;
    return i < full ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(tail, p);
  }
  int64_t full, count;
  __mmask64 tail;
};

// One pass over weight rows [n0, n1): int8 weights, `au` the activations
// as unsigned (a ^ 0x80), each row padded with zeros to `kp` bytes.
template <int64_t kRows>
void RowsInt8(const Int8Act* au, int64_t kp, const int8_t* w, int64_t k,
              int32_t* out, int64_t n_cols, int64_t n0, int64_t n1) {
  const __m512i ones = _mm512_set1_epi8(1);
  const Steps steps(k);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * k;
    __m512i acc[kRows];
    __m512i sw = _mm512_setzero_si512();
    for (int64_t m = 0; m < kRows; ++m) acc[m] = _mm512_setzero_si512();
    for (int64_t i = 0; i < steps.count; ++i) {
      __m512i wv = steps.Load(wr, i);
      sw = _mm512_dpbusd_epi32(sw, ones, wv);
      for (int64_t m = 0; m < kRows; ++m) {
        __m512i av = _mm512_loadu_si512(au + m * kp + i * kLane);
        acc[m] = _mm512_dpbusd_epi32(acc[m], av, wv);
      }
    }
    uint32_t s = uint32_t(_mm512_reduce_add_epi32(sw)) * 128u;
    for (int64_t m = 0; m < kRows; ++m) {
      uint32_t d = uint32_t(_mm512_reduce_add_epi32(acc[m]));
      out[m * n_cols + n] = int32_t(d - s);
    }
  }
}

// One pass over weight rows [n0, n1): packed int4 weights (k even, k / 2
// bytes a row), `ae` / `ao` the even / odd activations (signed), each row
// padded with zeros to `kp` bytes, `sa` each activation row's sum.
template <int64_t kRows>
void RowsInt4(const Int4Act* ae, const Int4Act* ao, const int32_t* sa,
              int64_t kp, const uint8_t* w, int64_t k, int32_t* out,
              int64_t n_cols, int64_t n0, int64_t n1) {
  const __m512i flip = _mm512_set1_epi8(char(0x88));
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t bytes = k / 2;
  const Steps steps(bytes);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * bytes;
    __m512i acc[kRows];
    for (int64_t m = 0; m < kRows; ++m) acc[m] = _mm512_setzero_si512();
    for (int64_t i = 0; i < steps.count; ++i) {
      __m512i v = _mm512_xor_si512(steps.Load(wr, i), flip);
      __m512i lo = _mm512_and_si512(v, low);
      __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      for (int64_t m = 0; m < kRows; ++m) {
        __m512i e = _mm512_loadu_si512(ae + m * kp + i * kLane);
        __m512i o = _mm512_loadu_si512(ao + m * kp + i * kLane);
        acc[m] = _mm512_dpbusd_epi32(acc[m], lo, e);
        acc[m] = _mm512_dpbusd_epi32(acc[m], hi, o);
      }
    }
    for (int64_t m = 0; m < kRows; ++m) {
      uint32_t d = uint32_t(_mm512_reduce_add_epi32(acc[m]));
      out[m * n_cols + n] = int32_t(d - 8u * uint32_t(sa[m]));
    }
  }
}

#elif defined(__AVX2__)

constexpr int64_t kLane = 32;  // Weight bytes a step: an AVX2 register.
using Int8Act = int16_t;  // Widened once per call; weights per step.
using Int4Act = int16_t;
inline Int8Act Int8ActOf(int8_t a) { return a; }

// A row of `bytes` bytes as `count` 32-byte loads, the last one padded
// with zeros past the row's end.
struct Steps {
  explicit Steps(int64_t bytes)
      : full(bytes / kLane), count((bytes + kLane - 1) / kLane),
        rest(bytes % kLane) {}
  __m256i Load(const void* row, int64_t i) const {
    const char* p = static_cast<const char*>(row) + i * kLane;
    if (i < full) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    alignas(32) char buf[kLane] = {0};
    std::memcpy(buf, p, rest);
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
  }
  int64_t full, count, rest;
};

inline int32_t Sum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v),
                            _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// acc += (32 int8 codes, widened) . (32 int16 activations at `a`).
inline __m256i Madd(__m256i acc, __m256i lo, __m256i hi, const int16_t* a) {
  acc = _mm256_add_epi32(
      acc, _mm256_madd_epi16(lo, _mm256_loadu_si256(
                                     reinterpret_cast<const __m256i*>(a))));
  return _mm256_add_epi32(
      acc, _mm256_madd_epi16(hi, _mm256_loadu_si256(
                                     reinterpret_cast<const __m256i*>(a + 16))));
}

inline __m256i Low16(__m256i v) {
  return _mm256_cvtepi8_epi16(_mm256_castsi256_si128(v));
}
inline __m256i High16(__m256i v) {
  return _mm256_cvtepi8_epi16(_mm256_extracti128_si256(v, 1));
}

// One pass over weight rows [n0, n1): int8 weights, `au` the activations
// as int16, each row padded with zeros to `kp` elements.
template <int64_t kRows>
void RowsInt8(const Int8Act* au, int64_t kp, const int8_t* w, int64_t k,
              int32_t* out, int64_t n_cols, int64_t n0, int64_t n1) {
  const Steps steps(k);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * k;
    __m256i acc[kRows];
    for (int64_t m = 0; m < kRows; ++m) acc[m] = _mm256_setzero_si256();
    for (int64_t i = 0; i < steps.count; ++i) {
      __m256i v = steps.Load(wr, i);
      __m256i lo = Low16(v), hi = High16(v);
      for (int64_t m = 0; m < kRows; ++m) {
        acc[m] = Madd(acc[m], lo, hi, au + m * kp + i * kLane);
      }
    }
    for (int64_t m = 0; m < kRows; ++m) out[m * n_cols + n] = Sum(acc[m]);
  }
}

// One pass over weight rows [n0, n1): packed int4 weights (k even), the
// nibbles sign-extended (((u & 0xF) ^ 8) - 8) against `ae` / `ao`, the even
// / odd activations as int16 padded to `kp`; `sa` is unused here.
template <int64_t kRows>
void RowsInt4(const Int4Act* ae, const Int4Act* ao, const int32_t* sa,
              int64_t kp, const uint8_t* w, int64_t k, int32_t* out,
              int64_t n_cols, int64_t n0, int64_t n1) {
  (void)sa;
  const __m256i low = _mm256_set1_epi8(0x0F), eight = _mm256_set1_epi8(8);
  const int64_t bytes = k / 2;
  const Steps steps(bytes);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * bytes;
    __m256i acc[kRows];
    for (int64_t m = 0; m < kRows; ++m) acc[m] = _mm256_setzero_si256();
    for (int64_t i = 0; i < steps.count; ++i) {
      __m256i v = steps.Load(wr, i);
      __m256i lo = _mm256_sub_epi8(
          _mm256_xor_si256(_mm256_and_si256(v, low), eight), eight);
      __m256i hi = _mm256_sub_epi8(
          _mm256_xor_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                           eight),
          eight);
      __m256i lo0 = Low16(lo), lo1 = High16(lo);
      __m256i hi0 = Low16(hi), hi1 = High16(hi);
      for (int64_t m = 0; m < kRows; ++m) {
        acc[m] = Madd(acc[m], lo0, lo1, ae + m * kp + i * kLane);
        acc[m] = Madd(acc[m], hi0, hi1, ao + m * kp + i * kLane);
      }
    }
    for (int64_t m = 0; m < kRows; ++m) out[m * n_cols + n] = Sum(acc[m]);
  }
}

#else
#error "aqtr native dot: build with AVX-512 VNNI or AVX2"
#endif

// Splits weight rows [0, n) into chunks that the caller and XLA's intra-op
// pool claim from one counter. The caller waits only for chunks another
// thread has claimed and is running, never for a task still queued: a pool
// busy with other work cannot deadlock the call.
template <typename F>
void Parallel(ffi::ThreadPool& pool, int64_t n, int64_t weight_bytes, F f) {
  int64_t threads = std::max<int64_t>(1, pool.num_threads());
  if (weight_bytes < (int64_t(1) << 20)) threads = 1;
  int64_t chunks = std::min<int64_t>(n, threads * 4);
  if (threads == 1 || chunks <= 1) {
    f(0, n);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto shared = std::make_shared<Shared>();
  int64_t size = (n + chunks - 1) / chunks;
  auto work = [shared, chunks, size, n, f] {
    for (int64_t c; (c = shared->next.fetch_add(1)) < chunks;) {
      f(std::min(n, c * size), std::min(n, (c + 1) * size));
      if (shared->done.fetch_add(1, std::memory_order_release) + 1 == chunks) {
        shared->done.notify_all();
      }
    }
  };
  for (int64_t t = 1; t < threads; ++t) pool.Schedule(decltype(work)(work));
  work();
  // A short spin, then sleep on the counter: on a host with more busy
  // threads than cores, spinning would hold the core the last chunk needs.
  for (int spin = 0; spin < 256; ++spin) {
    if (shared->done.load(std::memory_order_acquire) == chunks) return;
    _mm_pause();
  }
  for (int64_t d; (d = shared->done.load(std::memory_order_acquire)) < chunks;) {
    shared->done.wait(d, std::memory_order_acquire);
  }
}

int64_t Padded(int64_t bytes) { return (bytes + kLane - 1) / kLane * kLane; }

template <typename Pass>
void ByRowBlocks(int64_t m, Pass pass) {
  for (int64_t m0 = 0; m0 < m; m0 += kMaxRows) {
    switch (std::min(kMaxRows, m - m0)) {
      case 1: pass.template operator()<1>(m0); break;
      case 2: pass.template operator()<2>(m0); break;
      case 3: pass.template operator()<3>(m0); break;
      case 4: pass.template operator()<4>(m0); break;
      case 5: pass.template operator()<5>(m0); break;
      case 6: pass.template operator()<6>(m0); break;
      case 7: pass.template operator()<7>(m0); break;
      default: pass.template operator()<8>(m0); break;
    }
  }
}

ffi::Error IntRowsDot(ffi::ThreadPool pool, ffi::AnyBuffer a,
                      ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out) {
  auto ad = a.dimensions();
  auto wd = w.dimensions();
  const int64_t r = ad.size();
  // uint8 weights are int4 codes packed two a byte along K, the even code
  // in the low nibble: the bytes XLA:CPU keeps an s4 array in.
  const bool packed = w.element_type() == ffi::DataType::U8;
  const bool int4 = packed || w.element_type() == ffi::DataType::S4;
  if (r < 2 || int64_t(wd.size()) != r ||
      ad[r - 1] != (packed ? 2 * wd[r - 1] : wd[r - 1])) {
    return ffi::Error::InvalidArgument(
        "aqtr_int_rows_dot: operands must be [..., M, K] and [..., N, K] "
        "([..., N, K / 2] packed uint8)");
  }
  if (a.element_type() != ffi::DataType::S8 ||
      !(int4 || w.element_type() == ffi::DataType::S8)) {
    return ffi::Error::InvalidArgument(
        "aqtr_int_rows_dot: wants int8 activations, int8, int4 or packed "
        "uint8 weights");
  }
  const int64_t k = ad[r - 1], m = ad[r - 2], n = wd[r - 2];
  if (int4 && k % 2) {
    return ffi::Error::InvalidArgument(
        "aqtr_int_rows_dot: int4 weights need an even contraction size");
  }
  int64_t batch = 1;
  for (int64_t i = 0; i < r - 2; ++i) batch *= ad[i];
  const int8_t* ap = static_cast<const int8_t*>(a.untyped_data());
  const uint8_t* wp = static_cast<const uint8_t*>(w.untyped_data());
  int32_t* op = static_cast<int32_t*>(out->untyped_data());
  const int64_t w_row = int4 ? k / 2 : k;  // Bytes per weight row.
  const int64_t kp = Padded(w_row);
  // Activations of every batch entry first; then one parallel pass over
  // all batch x N weight rows (a tiled dot is many short batch entries).
  std::vector<Int8Act> au;
  std::vector<Int4Act> ae, ao;
  std::vector<int32_t> sa;
  if (!int4) {
    au.assign(batch * m * kp, 0);
    for (int64_t i = 0; i < batch * m; ++i) {
      for (int64_t j = 0; j < k; ++j) au[i * kp + j] = Int8ActOf(ap[i * k + j]);
    }
  } else {
    ae.assign(batch * m * kp, 0);
    ao.assign(batch * m * kp, 0);
    sa.assign(batch * m, 0);
    for (int64_t i = 0; i < batch * m; ++i) {
      int32_t s = 0;
      for (int64_t j = 0; j < k / 2; ++j) {
        ae[i * kp + j] = ap[i * k + 2 * j];
        ao[i * kp + j] = ap[i * k + 2 * j + 1];
        s += int32_t(ap[i * k + 2 * j]) + int32_t(ap[i * k + 2 * j + 1]);
      }
      sa[i] = s;
    }
  }
  ByRowBlocks(m, [&]<int64_t kRows>(int64_t m0) {
    // Global weight rows [r0, r1) of batch x N, cut at batch boundaries.
    auto rows = [&, m0](int64_t r0, int64_t r1) {
      while (r0 < r1) {
        const int64_t b = r0 / n, n0 = r0 % n;
        const int64_t n1 = std::min(n, n0 + (r1 - r0));
        const int64_t act = (b * m + m0) * kp;
        int32_t* ob = op + b * m * n + m0 * n;
        const uint8_t* wb = wp + b * n * w_row;
        if (!int4) {
          RowsInt8<kRows>(au.data() + act, kp,
                          reinterpret_cast<const int8_t*>(wb), k, ob, n, n0,
                          n1);
        } else {
          RowsInt4<kRows>(ae.data() + act, ao.data() + act,
                          sa.data() + b * m + m0, kp, wb, k, ob, n, n0, n1);
        }
        r0 += n1 - n0;
      }
    };
    Parallel(pool, batch * n, batch * n * w_row, rows);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AqtrIntRowsDot, IntRowsDot,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
