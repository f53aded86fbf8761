// Package hitrate explains a replica's cache hit rate: per model and per
// worker, over sliding windows, four fractions of the prompt tokens side by
// side (issue 18 item 3):
//
//   - available: what an unbounded pooled cache would have served — the
//     leading prompt blocks whose chained hash was seen before. Memory is
//     bounded (Config.MaxBlocks per model, ≈ 63 bytes a block), so "seen
//     before" means within the last MaxBlocks distinct blocks of the model's
//     traffic; the bound never falls below the fleet's capacity, so
//     available ≥ reachable always.
//   - reachable: what one pooled LRU cache of the fleet's capacity (the sum
//     of the registered workers' total_kv_blocks) would have served on the
//     same block stream, run as kvbench's pooled-LRU reference runs it.
//   - captured: what routing captured — the router's predicted cached
//     tokens on the chosen worker.
//   - delivered: what the engines delivered — their reported cached tokens
//     (usage.prompt_tokens_details.cached_tokens), over the prompt tokens
//     they reported.
//
// available and reachable are properties of a model's traffic and fleet, so
// they are per model (fleet-wide); captured and delivered are per model and
// per worker. The gaps between neighbours name their usual causes (Gaps).
//
// All four apply the engines' rule that a prompt cached whole still computes
// its last block (Tokens), so a perfect router on a perfect engine shows
// captured = delivered.
//
// A replica sees only the requests it routes: with several replicas behind
// a balancer each one's available and reachable are those of its share of
// the traffic (a lower bound of the fleet's).
package hitrate

import (
	"sync"
	"time"
)

// Window is one sliding window the rates are reported over.
type Window struct {
	Name string        // the label value, e.g. "1m"
	Span time.Duration // a multiple of Config.Bucket
}

// Config sets the bounds. Zero values take the defaults named.
type Config struct {
	// MaxBlocks bounds each model's block history (available); default
	// 1 Mi blocks (≈ 64 MiB per model when full). Raised to the fleet's
	// capacity when that is larger.
	MaxBlocks int
	// Bucket is the windows' granularity; default 10 s.
	Bucket time.Duration
	// Windows default to 1m and 10m.
	Windows []Window
	// CapacityEvery is how often a model's fleet capacity is re-read
	// (Capacity); default 1 s.
	CapacityEvery time.Duration
}

// DefaultMaxBlocks is Config.MaxBlocks' default.
const DefaultMaxBlocks = 1 << 20

// Capacity returns the KV blocks of the model's registered workers (the
// sum of total_kv_blocks; workers without one count 0).
type Capacity func(model string) int

// Tracker computes the rates. Safe for concurrent use.
type Tracker struct {
	cfg      Config
	capacity Capacity
	span     int64 // buckets in the longest window

	mu     sync.Mutex // guards models (each model has its own lock)
	models map[string]*model

	smu       sync.Mutex // guards series and lastSweep
	series    map[seriesKey]*ring
	lastSweep int64
}

type model struct {
	mu       sync.Mutex // guards everything below
	cache    *stack
	capBlks  int
	capAt    time.Time
	capKnown bool
}

type seriesKey struct{ model, worker string } // worker "": the model's aggregate

// New returns a tracker reading fleet capacities from capacity.
func New(cfg Config, capacity Capacity) *Tracker {
	if cfg.MaxBlocks <= 0 {
		cfg.MaxBlocks = DefaultMaxBlocks
	}
	if cfg.Bucket <= 0 {
		cfg.Bucket = 10 * time.Second
	}
	if len(cfg.Windows) == 0 {
		cfg.Windows = []Window{{"1m", time.Minute}, {"10m", 10 * time.Minute}}
	}
	if cfg.CapacityEvery <= 0 {
		cfg.CapacityEvery = time.Second
	}
	t := &Tracker{cfg: cfg, capacity: capacity, models: map[string]*model{}, series: map[seriesKey]*ring{}}
	for _, w := range cfg.Windows {
		t.span = max(t.span, int64((w.Span+cfg.Bucket-1)/cfg.Bucket))
	}
	return t
}

// Windows returns the windows reported.
func (t *Tracker) Windows() []Window { return t.cfg.Windows }

// Reuse is what the two reference caches held of one request's prompt, in
// prompt tokens.
type Reuse struct {
	Available int
	Reachable int
}

// Arrive runs one request's prompt blocks (its chained block hashes, in
// order) through the model's reference caches, once per request at its
// first routing decision, and returns what they held of it. promptTokens
// is the prompt's length, blockSize the model's block size.
func (t *Tracker) Arrive(now time.Time, modelName string, hashes []uint64, promptTokens, blockSize int) Reuse {
	t.mu.Lock()
	m, ok := t.models[modelName]
	if !ok {
		m = &model{cache: newStack(t.cfg.MaxBlocks)}
		t.models[modelName] = m
	}
	t.mu.Unlock()

	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.capKnown || now.Sub(m.capAt) >= t.cfg.CapacityEvery || now.Before(m.capAt) {
		// Re-read at most every CapacityEvery: summing the registry on
		// every request would cost more than the cache itself.
		m.capBlks, m.capAt, m.capKnown = 0, now, true
		if t.capacity != nil {
			m.capBlks = t.capacity(modelName)
		}
		m.cache.max = max(t.cfg.MaxBlocks, m.capBlks)
	}
	a, r := m.cache.admit(hashes, m.capBlks)
	return Reuse{Available: Tokens(a, blockSize, promptTokens), Reachable: Tokens(r, blockSize, promptTokens)}
}

// Tokens converts matched leading blocks into cached prompt tokens. A
// prompt cached whole still computes its last block: an engine must run
// at least one prompt token to produce the first output token (vLLM,
// SGLang; kvbench's reference applies the same rule).
func Tokens(blocks, blockSize, promptTokens int) int {
	if blocks <= 0 || blockSize <= 0 {
		return 0
	}
	if blocks*blockSize >= promptTokens {
		blocks--
	}
	return blocks * blockSize
}

// Sample is one served request's account.
type Sample struct {
	PromptTokens int   // as the router tokenized the prompt
	Reuse        Reuse // from Arrive
	Captured     int   // the router's predicted cached tokens on the chosen worker (Tokens)
	// Reported says the engine's answer carried usage; EnginePrompt and
	// EngineCached are its prompt_tokens and cached_tokens (0 when the
	// engine leaves prompt_tokens_details out).
	Reported     bool
	EnginePrompt int
	EngineCached int
}

// Record adds one served request to the windows of its model and worker.
func (t *Tracker) Record(now time.Time, modelName, worker string, s Sample) {
	b := now.UnixNano() / int64(t.cfg.Bucket)
	t.smu.Lock()
	defer t.smu.Unlock()
	t.add(seriesKey{modelName, ""}, b, s)
	t.add(seriesKey{modelName, worker}, b, s)
}

// add adds s to one series' bucket b; smu must be held.
func (t *Tracker) add(k seriesKey, b int64, s Sample) {
	r, ok := t.series[k]
	if !ok {
		// A new series is when series of gone workers may be dropped:
		// sweeping then (at most once per longest window) bounds the map
		// by the workers seen within it, scraped or not.
		if b-t.lastSweep >= t.span {
			t.sweep(b)
		}
		r = newRing(t.span)
		t.series[k] = r
	}
	r.add(b, s)
}

// sweep drops series with nothing in any window; smu must be held.
func (t *Tracker) sweep(b int64) {
	t.lastSweep = b
	for k, r := range t.series {
		if r.newest <= b-t.span {
			delete(t.series, k)
		}
	}
}

// sums are one bucket's (or one window's) totals.
type sums struct {
	Requests      int64
	PromptTokens  int64
	Available     int64
	Reachable     int64
	Captured      int64
	Reported      int64 // requests whose answer carried usage
	ReportedPrmpt int64 // their prompt tokens, as the engines counted them
	EngineCached  int64
}

func (s *sums) add(x Sample) {
	s.Requests++
	s.PromptTokens += int64(x.PromptTokens)
	s.Available += int64(x.Reuse.Available)
	s.Reachable += int64(x.Reuse.Reachable)
	s.Captured += int64(x.Captured)
	if x.Reported {
		s.Reported++
		s.ReportedPrmpt += int64(x.EnginePrompt)
		s.EngineCached += int64(x.EngineCached)
	}
}

func (s *sums) plus(o sums) {
	s.Requests += o.Requests
	s.PromptTokens += o.PromptTokens
	s.Available += o.Available
	s.Reachable += o.Reachable
	s.Captured += o.Captured
	s.Reported += o.Reported
	s.ReportedPrmpt += o.ReportedPrmpt
	s.EngineCached += o.EngineCached
}

// ring is one series' buckets: slot b%len holds bucket b when at[slot]==b.
type ring struct {
	at     []int64
	b      []sums
	newest int64
}

func newRing(n int64) *ring {
	r := &ring{at: make([]int64, n), b: make([]sums, n)}
	for i := range r.at {
		r.at[i] = -1
	}
	return r
}

func (r *ring) add(b int64, s Sample) {
	i := b % int64(len(r.at))
	if r.at[i] != b {
		r.at[i], r.b[i] = b, sums{}
	}
	r.b[i].add(s)
	r.newest = max(r.newest, b)
}

// window sums the n buckets ending with b (b included: the current one,
// partly filled, so a window covers between span−bucket and span).
func (r *ring) window(b, n int64) sums {
	var out sums
	for x := b - n + 1; x <= b; x++ {
		if x < 0 {
			continue
		}
		if i := x % int64(len(r.at)); r.at[i] == x {
			out.plus(r.b[i])
		}
	}
	return out
}
