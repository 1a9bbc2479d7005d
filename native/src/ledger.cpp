// The instance's local queue and per-batch bookkeeping (see ledger.h).
#include "ledger.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace gpuprims {

Ledger::Ledger(Pool* pool, uint32_t consumer) : pool_(pool), consumer_(consumer) {
  pool_->check_consumer(consumer);
  const uint32_t records = pool_->view().hdr->record_count;
  ring_.resize(records);
  polled_.resize(records);
  // Reserved once: the batch views handed to Python point into these and must not move.
  batch_recs_.resize(records);
  batch_.resize(records);
  tmp_recs_.resize(records);
  tmp_gens_.resize(records);
  tmp_status_.resize(records);
}

Ledger::Slot& Ledger::at(size_t i) {
  if (i >= count_) throw std::out_of_range("queue index " + std::to_string(i) + " out of range");
  return ring_[(head_ + i) % ring_.size()];
}

const Ledger::Slot& Ledger::at(size_t i) const {
  if (i >= count_) throw std::out_of_range("queue index " + std::to_string(i) + " out of range");
  return ring_[(head_ + i) % ring_.size()];
}

double Ledger::deadline_ms(size_t i, double default_ms) const {
  const uint32_t d = at(i).rec.deadline_us;
  return d ? d / 1e3 : default_ms;
}

size_t Ledger::pull(size_t max_n, int64_t timeout_us, int64_t spin_us, std::vector<double>* arrivals_ms) {
  // The queue holds every record this consumer can own, so there is always room unless records were
  // delivered twice; take no more than fits either way.
  const size_t room = ring_.size() - count_;
  if (max_n > room) max_n = room;
  if (max_n == 0) return 0;
  const size_t n = pool_->poll(consumer_, polled_.data(), max_n, timeout_us, spin_us);
  const pool::View& v = pool_->view();
  for (size_t i = 0; i < n; ++i) {
    const uint32_t ri = polled_[i];
    if (ri >= v.hdr->record_count) throw std::out_of_range("record index " + std::to_string(ri) + " out of range");
    Slot& s = ring_[(head_ + count_) % ring_.size()];
    std::memcpy(static_cast<void*>(&s.rec), static_cast<const void*>(v.record(ri)), sizeof s.rec);
    s.index = ri;
    ++count_;
    if (arrivals_ms) arrivals_ms->push_back(double(s.rec.complete_ns) / 1e6);
  }
  return n;
}

void Ledger::publish(const uint32_t* recs, const uint32_t* gens, size_t n, const uint16_t* statuses,
                     const uint8_t* body, size_t row_bytes, uint8_t dtype, int64_t timeout_us) {
  if (n == 0) return;
  const size_t done = pool_->answer(consumer_, recs, gens, n, statuses, body, row_bytes, dtype, timeout_us);
  if (done != n)
    throw std::runtime_error("the ingest took no answers of consumer " + std::to_string(consumer_) + " for " +
                             std::to_string(double(timeout_us) / 1e6) + " s (" + std::to_string(done) + " of " +
                             std::to_string(n) + " published): it is gone or stuck");
}

size_t Ledger::pop_answer(size_t k, uint16_t status, int64_t timeout_us) {
  if (k > count_) k = count_;
  for (size_t i = 0; i < k; ++i) {
    const Slot& s = ring_[(head_ + i) % ring_.size()];
    tmp_recs_[i] = s.index;
    tmp_gens_[i] = s.rec.generation;
    tmp_status_[i] = status;
  }
  // Off the queue first: whatever publish does, these requests are no longer this loop's to serve
  // (an answer published is sent; one not published is answered by the ingest's reclaim).
  head_ = (head_ + k) % ring_.size();
  count_ -= k;
  publish(tmp_recs_.data(), tmp_gens_.data(), k, tmp_status_.data(), nullptr, 0, wire::kDTypeBytes, timeout_us);
  return k;
}

size_t Ledger::expire(uint64_t now_ns, double default_ms, double need_ms, int64_t timeout_us) {
  size_t k = 0;
  for (; k < count_; ++k) {
    const RecordCopy& r = ring_[(head_ + k) % ring_.size()].rec;
    const double age = now_ns > r.first_ns ? double(now_ns - r.first_ns) / 1e6 : 0.0;
    const double deadline = r.deadline_us ? r.deadline_us / 1e3 : default_ms;
    if (age < deadline && !(need_ms >= 0 && age + need_ms > deadline)) break;
  }
  return pop_answer(k, wire::kStatusDeadlineMissed, timeout_us);
}

size_t Ledger::fail_head(size_t k, uint16_t status, int64_t timeout_us) { return pop_answer(k, status, timeout_us); }

size_t Ledger::take(size_t k, uint32_t row_bytes, const uint8_t* dtype_ok, int64_t timeout_us, uint8_t* rows) {
  const bool any_size = row_bytes == kAnySize;
  // Checked before anything leaves the queue: with no row size there is nowhere to copy a body to.
  if (any_size && rows != nullptr) throw std::invalid_argument("take: rows must be None with row_bytes ANY_SIZE");
  if (k > count_) k = count_;
  size_t good = 0, bad = 0;
  for (size_t i = 0; i < k; ++i) {
    const Slot& s = ring_[(head_ + i) % ring_.size()];
    if ((any_size || s.rec.total_len == row_bytes) && dtype_ok[s.rec.dtype] &&
        (rows == nullptr || pool_->gather(&s.index, 1, rows + good * size_t(row_bytes), row_bytes).empty())) {
      batch_recs_[good] = s.index;
      batch_[good] = s.rec;
      ++good;
    } else {
      tmp_recs_[bad] = s.index;
      tmp_gens_[bad] = s.rec.generation;
      tmp_status_[bad] = wire::kStatusBadRequest;
      ++bad;
    }
  }
  head_ = (head_ + k) % ring_.size();
  count_ -= k;
  batch_n_ = good;
  publish(tmp_recs_.data(), tmp_gens_.data(), bad, tmp_status_.data(), nullptr, 0, wire::kDTypeBytes, timeout_us);
  return good;
}

namespace {
// Count v (seconds) in `counts` over `bounds`; returns what it adds to the sum.
double count_duration(const double* bounds, size_t n, int64_t* counts, double v) {
  if (!(v > 0.0)) v = 0.0;
  counts[std::lower_bound(bounds, bounds + n, v) - bounds] += 1;
  return v;
}
}  // namespace

Answered Ledger::answer_batch(const uint8_t* body, size_t row_bytes, uint8_t dtype, double default_ms,
                              int64_t timeout_us, double* lat_ms, Histograms* hist) {
  const size_t n = batch_n_;
  for (size_t i = 0; i < n; ++i) {
    tmp_gens_[i] = batch_[i].generation;
    tmp_status_[i] = wire::kStatusOk;
  }
  // A row too large for the answer ring throws before anything is published: the batch stays current,
  // so the caller can still answer it with an error.
  try {
    publish(batch_recs_.data(), tmp_gens_.data(), n, tmp_status_.data(), body, row_bytes, dtype, timeout_us);
  } catch (const std::runtime_error&) {
    batch_n_ = 0;  // some may have been published: answering them again would answer them twice
    throw;
  }
  batch_n_ = 0;
  Answered a;
  a.done_ns = now_ns();
  for (size_t i = 0; i < n; ++i) {
    const RecordCopy& r = batch_[i];
    const double lat = a.done_ns > r.first_ns ? double(a.done_ns - r.first_ns) / 1e6 : 0.0;
    lat_ms[i] = lat;
    const double deadline = r.deadline_us ? r.deadline_us / 1e3 : default_ms;
    if (lat <= deadline) ++a.within;
    if (hist) {
      hist->request_sum += count_duration(hist->bounds, hist->bounds_n, hist->request, lat / 1e3);
      hist->queue_sum += count_duration(hist->bounds, hist->bounds_n, hist->queue, lat / 1e3 - hist->compute_s);
      hist->compute_sum += count_duration(hist->bounds, hist->bounds_n, hist->compute, hist->compute_s);
    }
    if (i == 0 || r.first_ns < a.oldest_first_ns) {
      a.oldest_first_ns = r.first_ns;
      a.oldest_complete_ns = r.complete_ns;
    }
  }
  return a;
}

}  // namespace gpuprims
