/* Attention over a paged KV pool on the CPU, for requests with few queries each (decode
   steps, speculative verify and draft trees): each request's K/V rows are read in place
   through its slot list, with no gathered copy.  Compiled on first use and called through
   ctypes by cpu_attention.py; its OpenMP team is torch's (the same libgomp). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int is_bf16;                 /* q, K/V and out are bfloat16 (else float32) */
    const void *q;               /* [N, H, D], strides q_row, q_head, 1 */
    const void *k, *v;           /* [slots, Hkv, D] contiguous */
    void *out;                   /* [N, H, D] contiguous */
    int64_t H, Hkv, D, q_row, q_head;
    const int64_t *qo_indptr, *kv_indptr, *kv_indices;   /* [B + 1], [B + 1], [nnz] */
    const uint8_t *mask;         /* per request [qo, kv] row-major, concatenated; NULL: causal */
    const int64_t *mask_offsets; /* [B] where each request's mask starts */
    float scale;
} Args;

static inline float load(const Args *a, const void *base, int64_t i) {
    if (!a->is_bf16) return ((const float *)base)[i];
    union { uint32_t u; float f; } v;
    v.u = ((uint32_t)((const uint16_t *)base)[i]) << 16;
    return v.f;
}

static inline void store(const Args *a, int64_t i, float f) {
    if (!a->is_bf16) { ((float *)a->out)[i] = f; return; }
    union { uint32_t u; float f; } v;
    v.f = f;  /* round to nearest even, as torch does */
    ((uint16_t *)a->out)[i] = isnan(f) ? 0x7fc0 : (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* Ask for the row of kv heads [h0, h0 + nh) at ``slot`` while the current one is used. */
static inline void prefetch_row(const Args *a, const void *buf, int64_t slot, int64_t h0) {
    __builtin_prefetch((const char *)buf + (slot * a->Hkv + h0) * a->D * (a->is_bf16 ? 2 : 4));
}

/* kv heads [h0, h0 + nh) at ``slot`` as float32 (bfloat16 converted into ``tmp``) */
static const float *kv_row(const Args *a, const void *buf, int64_t slot, int64_t h0,
                           int64_t nh, float *tmp) {
    int64_t base = (slot * a->Hkv + h0) * a->D;
    if (!a->is_bf16) return (const float *)buf + base;
    for (int64_t d = 0; d < nh * a->D; d++) tmp[d] = load(a, buf, base + d);
    return tmp;
}

/* Request i's queries of the heads that read kv heads [h0, h0 + nh), as rows
   r = (head - h0 * g) * qo + j for query j; scratch holds [rows, D] queries, [rows, D]
   sums, [rows, kv] scores and one converted row. */
static void attend(const Args *a, int64_t i, int64_t h0, int64_t nh, float *scratch) {
    const int64_t D = a->D, g = a->H / a->Hkv;
    const int64_t q0 = a->qo_indptr[i], qo = a->qo_indptr[i + 1] - q0;
    const int64_t kv = a->kv_indptr[i + 1] - a->kv_indptr[i];
    const int64_t *slots = a->kv_indices + a->kv_indptr[i];
    const uint8_t *mask = a->mask ? a->mask + a->mask_offsets[i] : NULL;
    const int64_t rows = nh * g * qo;
    float *qf = scratch, *acc = qf + rows * D, *s = acc + rows * D, *tmp = s + rows * kv;

    for (int64_t r = 0; r < rows; r++) {
        int64_t j = r % qo, head = h0 * g + r / qo;
        for (int64_t d = 0; d < D; d++)
            qf[r * D + d] = a->scale * load(a, a->q, (q0 + j) * a->q_row + head * a->q_head + d);
    }
    for (int64_t p = 0; p < kv; p++) {  /* scores: every row against K at position p */
        if (p + 1 < kv) prefetch_row(a, a->k, slots[p + 1], h0);
        const float *k = kv_row(a, a->k, slots[p], h0, nh, tmp);
        for (int64_t r = 0; r < rows; r++) {
            const float *kh = k + (r / (g * qo)) * D, *qr = qf + r * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; d++) dot += qr[d] * kh[d];
            s[r * kv + p] = dot;
        }
    }
    for (int64_t r = 0; r < rows; r++) {  /* masked softmax over each row */
        int64_t j = r % qo, last = kv - qo + j;  /* causal: positions up to the query's own */
        float *sr = s + r * kv, mx = -INFINITY, sum = 0.f;
        for (int64_t p = 0; p < kv; p++) {
            if (mask ? !mask[j * kv + p] : p > last) sr[p] = -INFINITY;
            else if (sr[p] > mx) mx = sr[p];
        }
        for (int64_t p = 0; p < kv; p++) {
            sr[p] = sr[p] == -INFINITY ? 0.f : expf(sr[p] - mx);
            sum += sr[p];
        }
        float inv = sum > 0.f ? 1.f / sum : 0.f;  /* a row that sees nothing gives zeros */
        for (int64_t p = 0; p < kv; p++) sr[p] *= inv;
    }
    memset(acc, 0, sizeof(float) * rows * D);
    for (int64_t p = 0; p < kv; p++) {  /* weighted sum of V */
        if (p + 1 < kv) prefetch_row(a, a->v, slots[p + 1], h0);
        const float *v = kv_row(a, a->v, slots[p], h0, nh, tmp);
        for (int64_t r = 0; r < rows; r++) {
            const float w = s[r * kv + p], *vh = v + (r / (g * qo)) * D;
            float *ar = acc + r * D;
            if (w == 0.f) continue;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) ar[d] += w * vh[d];
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t j = r % qo, head = h0 * g + r / qo;
        for (int64_t d = 0; d < D; d++) store(a, ((q0 + j) * a->H + head) * D + d, acc[r * D + d]);
    }
}

/* Whether every index stays inside its tensor: N queries, nnz slot entries, num_slots
   pool rows (a bad one would read or write outside them). */
static int indices_valid(int64_t B, int64_t N, int64_t nnz, int64_t num_slots,
                         const int64_t *qo_indptr, const int64_t *kv_indptr,
                         const int64_t *kv_indices, const int64_t *reqs, int64_t R) {
    if (qo_indptr[0] < 0 || kv_indptr[0] < 0 || qo_indptr[B] > N || kv_indptr[B] > nnz) return 0;
    for (int64_t i = 0; i < B; i++)
        if (qo_indptr[i + 1] < qo_indptr[i] || kv_indptr[i + 1] < kv_indptr[i]) return 0;
    for (int64_t p = kv_indptr[0]; p < kv_indptr[B]; p++)
        if (kv_indices[p] < 0 || kv_indices[p] >= num_slots) return 0;
    for (int64_t t = 0; t < R; t++)
        if (reqs[t] < 0 || reqs[t] >= B) return 0;
    return 1;
}

/* Attention for the R requests ``reqs`` of a batch of B (the others' rows of out are left
   as they are).  Returns 0; 1 when scratch memory could not be had; 2 for an index
   outside its tensor (nothing computed). */
int specd_paged_attention(int is_bf16, const void *q, const void *k, const void *v, void *out,
                          int64_t N, int64_t H, int64_t Hkv, int64_t D, int64_t q_row,
                          int64_t q_head, int64_t num_slots, int64_t B,
                          const int64_t *qo_indptr, const int64_t *kv_indptr,
                          const int64_t *kv_indices, int64_t nnz, const uint8_t *mask, int64_t mask_len,
                          const int64_t *reqs, int64_t R, float scale, int num_threads) {
    if (!indices_valid(B, N, nnz, num_slots, qo_indptr, kv_indptr, kv_indices, reqs, R))
        return 2;
    Args a = {is_bf16, q, k, v, out, H, Hkv, D, q_row, q_head,
              qo_indptr, kv_indptr, kv_indices, mask, NULL, scale};
    int64_t *offsets = malloc(sizeof(int64_t) * (B > 0 ? B : 1)), need = 0, off = 0;
    if (!offsets) return 1;
    int64_t max_qo = 0;
    for (int64_t t = 0; t < R; t++) {
        int64_t qo = qo_indptr[reqs[t] + 1] - qo_indptr[reqs[t]];
        if (qo > max_qo) max_qo = qo;
    }
    /* whole requests per task once there are enough of them and their rows are few (each
       K/V row read in one piece), else one kv head per task so that every thread has work
       and the scores of a task stay small */
    const int64_t nh = R >= 4 * num_threads && max_qo * H <= 64 ? Hkv : 1;
    const int64_t tasks = R * (Hkv / nh);
    for (int64_t i = 0; i < B; i++) {
        offsets[i] = off;
        off += (qo_indptr[i + 1] - qo_indptr[i]) * (kv_indptr[i + 1] - kv_indptr[i]);
    }
    if (mask && off != mask_len) {
        free(offsets);
        return 2;
    }
    for (int64_t t = 0; t < R; t++) {
        int64_t i = reqs[t], kv = kv_indptr[i + 1] - kv_indptr[i];
        int64_t rows = nh * (H / Hkv) * (qo_indptr[i + 1] - qo_indptr[i]);
        int64_t n = 2 * rows * D + rows * kv + nh * D;
        if (n > need) need = n;
    }
    a.mask_offsets = offsets;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc(sizeof(float) * (need > 0 ? need : 1));
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            int64_t i = reqs[t / (Hkv / nh)], h0 = (t % (Hkv / nh)) * nh;
            if (!scratch) {
#pragma omp atomic write
                failed = 1;
            } else if (qo_indptr[i + 1] > qo_indptr[i]) {
                attend(&a, i, h0, nh, scratch);
            }
        }
        free(scratch);
    }
    free(offsets);
    return failed;
}
