// Package workload builds the request sequences kvbench replays: synthetic
// shared-prefix workloads (seed 002) and Mooncake traces. A workload is
// generated once and then replayed unchanged by every policy, so policies
// are compared on identical requests; every request's block hashes are
// computed here, once, with the router's own hashing.
package workload

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"gonum.org/v1/gonum/stat/distuv"

	"github.com/kvrouter/kvrouter/router"
)

// Vocab is the size of the token-id space random tokens are drawn from
// (Qwen3's vocabulary, the model of the seeds).
const Vocab = 151936

// Kind says how a workload's requests arrive.
type Kind int

// Workload kinds.
const (
	// Synthetic: a closed loop of Concurrency clients; request i is the i-th
	// request sent, whichever client sends it. With OpenLoop, request i is
	// sent at its At instead, whether or not the fleet keeps up.
	Synthetic Kind = iota
	// Trace: open loop at each request's At, except rows of a session, which
	// wait for the previous turn of their session to finish.
	Trace
)

func (k Kind) String() string {
	if k == Trace {
		return "trace"
	}
	return "synthetic"
}

// NoSession marks a request that belongs to no session.
const NoSession = -1

// Request is one request of a workload.
type Request struct {
	ID           string
	PromptTokens int
	OutputTokens int
	// Hashes are the router's sequence hashes of the prompt's full blocks.
	Hashes []uint64
	// At is the open-loop arrival time (traces, and synthetic workloads
	// with an arrival rate); zero for closed loops.
	At time.Duration
	// Session is an index into Workload.Sessions, or NoSession.
	Session int
	// NextTurn is the index of the session's next turn, or -1.
	NextTurn int
	// HitTokens is how many cached prompt tokens make this request a hit:
	// half its shared prefix (synthetic) or one block (traces).
	HitTokens int
	// Prefix is the synthetic prefix the request starts with (-1 for traces).
	Prefix int
	// SharedTokens is the length of the prefix shared with other requests
	// (synthetic only).
	SharedTokens int
	// Think is how long after this request finishes its session's next
	// turn and its Children are sent (agent sessions, sessions.go; a
	// trace's next row's think_ms: that turn goes at max(its At, this
	// turn's end + Think)).
	Think time.Duration
	// Children are the first turns of the subagent sessions this request
	// spawns when it finishes (agent sessions).
	Children []int
}

// Workload is an immutable request sequence. It is safe to replay it from
// several goroutines at once.
type Workload struct {
	Kind        Kind
	Name        string
	BlockSize   int
	Seed        uint64
	Concurrency int // closed-loop clients (synthetic, unless OpenLoop)
	// OpenLoop: a synthetic workload whose requests arrive at their At (an
	// arrival process at ArrivalRate), not from Concurrency clients.
	OpenLoop    bool
	ArrivalRate float64 // requests per second (OpenLoop)
	Requests    []Request
	// Live is what the fleet that served a captured trace delivered (nil:
	// not a capture, or a row without cached_tokens).
	Live *Live
	// Sessions lists, per session, the indices of its turns in order.
	Sessions [][]int
	// Agent: a synthetic workload of agent sessions (sessions.go): the
	// sessions in Roots start at their first turn's At (OpenLoop) or as
	// Concurrency clients free up, every other turn when the turn before
	// it (or the parent turn that spawned it) finished, Think later.
	Agent bool
	// Roots are the top-level sessions (not subagents), in start order.
	Roots []int
	// SessionRoot is, per session, the top-level session it belongs to
	// (itself for a top-level one): subagents are grouped under it.
	SessionRoot []int
	// Tenants names the tenants of per-tenant streams
	// (SyntheticSpec.Tenants) and TenantOf is each request's index into
	// it; both nil otherwise.
	Tenants  []string
	TenantOf []int

	// token sources: synthetic prefixes and tails, or trace hash ids.
	prefixes [][]uint32
	tails    [][]uint32
	hashIDs  [][]uint64
	idTokens []int      // trace rows: tokens per hash id
	prompts  [][]uint32 // agent sessions: each request's whole prompt
}

// Live is a captured trace's engine-reported figures, over all its rows,
// with the simulator's definitions (a hit: at least one cached block).
type Live struct {
	Requests         int     `json:"requests"`
	RequestHitRate   float64 `json:"request_hit_rate"`
	CachedTokenRatio float64 `json:"cached_token_ratio"`
}

// ErrSpec marks an impossible workload specification.
var ErrSpec = errors.New("invalid workload")

// Prefix orders of the synthetic workload.
const (
	// PrefixRandom: each request draws its prefix uniformly at random.
	PrefixRandom = "random"
	// PrefixShuffled: every prefix equally often (±1), in a random order, as
	// in seed 001 ("each prefix sent 6 times, mixed").
	PrefixShuffled = "shuffled"
)

// SyntheticSpec describes seed 002's workload: K prefixes of P random tokens,
// each request one of them (uniformly at random) plus T fresh random tokens.
type SyntheticSpec struct {
	Prefixes     int
	PrefixTokens int
	TailTokens   int
	OutputTokens int
	Requests     int
	Concurrency  int
	BlockSize    int
	Seed         uint64
	Order        string // PrefixRandom (default) or PrefixShuffled
	// Popularity is how requests pick prefixes with PrefixRandom: "" or
	// "uniform", or "zipf:S" (prefix of popularity rank r drawn with
	// probability ∝ 1/(r+1)^S, S > 0).
	Popularity string
	// HotShift > 0 moves the popularity: every HotShift requests the ranks
	// are dealt to the prefixes again by a fresh random permutation, so the
	// hot set moves to other prefixes.
	HotShift int
	// Agent, when its Turns > 0, makes the requests agent sessions
	// (sessions.go): Requests counts every turn of every session, and
	// ArrivalRate and Concurrency apply to top-level sessions.
	Agent AgentSpec
	// ArrivalRate > 0 makes the workload open loop: requests arrive at
	// this mean rate (per second), Concurrency is ignored. The gaps are
	// gamma-distributed with coefficient of variation ArrivalCV (0 means
	// 1: a Poisson process; above 1, bursty).
	ArrivalRate float64
	ArrivalCV   float64
	// Tenants, when set (open loop, independent requests only), makes the
	// requests per-tenant streams (tenants.go): each tenant sends its
	// weight's share of Requests at its share of ArrivalRate, drawn from
	// its own seed, so its requests do not depend on the other tenants.
	Tenants []TenantStream
	// TenantPrefixes, with Tenants: TenantPrefixesShared ("" too) draws
	// every tenant's prefixes from the one pool of the spec's seed;
	// TenantPrefixesOwn gives each tenant a pool of its own (Prefixes
	// prefixes of PrefixTokens, from the tenant's seed), so no two tenants'
	// prompts share a cached block, as tenants of a real fleet mostly do
	// not (vLLM's cache_salt even forbids it).
	TenantPrefixes string
}

// ParsePopularity checks a popularity spec and returns the Zipf exponent
// (0 for uniform).
func ParsePopularity(p string) (float64, error) {
	switch {
	case p == "" || p == "uniform":
		return 0, nil
	case strings.HasPrefix(p, "zipf:"):
		v, err := strconv.ParseFloat(strings.TrimPrefix(p, "zipf:"), 64)
		if err != nil || !(v > 0) || v > 100 {
			return 0, fmt.Errorf("popularity %q: want zipf:S with 0 < S <= 100: %w", p, ErrSpec)
		}
		return v, nil
	}
	return 0, fmt.Errorf("popularity %q: want uniform or zipf:S: %w", p, ErrSpec)
}

// NewSynthetic generates the workload of spec. The same spec gives the same
// requests, token for token.
func NewSynthetic(s SyntheticSpec) (*Workload, error) {
	switch {
	case s.Prefixes <= 0:
		return nil, fmt.Errorf("%d prefixes: need at least one: %w", s.Prefixes, ErrSpec)
	case s.PrefixTokens < 0 || s.TailTokens < 0:
		return nil, fmt.Errorf("negative prefix or tail tokens: %w", ErrSpec)
	case s.PrefixTokens+s.TailTokens == 0:
		return nil, fmt.Errorf("empty prompts (prefix and tail tokens both 0): %w", ErrSpec)
	case s.OutputTokens <= 0:
		return nil, fmt.Errorf("%d output tokens: need at least one: %w", s.OutputTokens, ErrSpec)
	case s.Requests <= 0:
		return nil, fmt.Errorf("%d requests: need at least one: %w", s.Requests, ErrSpec)
	case s.Concurrency <= 0:
		return nil, fmt.Errorf("concurrency %d: need at least one client: %w", s.Concurrency, ErrSpec)
	case s.BlockSize <= 0:
		return nil, fmt.Errorf("block size %d: %w", s.BlockSize, ErrSpec)
	case s.Order != "" && s.Order != PrefixRandom && s.Order != PrefixShuffled:
		return nil, fmt.Errorf("prefix order %q: %w", s.Order, ErrSpec)
	case s.HotShift < 0:
		return nil, fmt.Errorf("hot shift %d: must not be negative: %w", s.HotShift, ErrSpec)
	case s.ArrivalRate < 0 || math.IsInf(s.ArrivalRate, 0) || math.IsNaN(s.ArrivalRate):
		return nil, fmt.Errorf("arrival rate %v: want a finite rate >= 0: %w", s.ArrivalRate, ErrSpec)
	case s.ArrivalCV < 0 || math.IsInf(s.ArrivalCV, 0) || math.IsNaN(s.ArrivalCV):
		return nil, fmt.Errorf("arrival CV %v: want a finite value > 0: %w", s.ArrivalCV, ErrSpec)
	}
	zipf, err := ParsePopularity(s.Popularity)
	if err != nil {
		return nil, err
	}
	if err := s.Agent.Check(); err != nil {
		return nil, err
	}
	if err := checkTenantStreams(s); err != nil {
		return nil, err
	}
	if s.Order == PrefixShuffled && (zipf > 0 || s.HotShift > 0) {
		return nil, fmt.Errorf("prefix order %q sends every prefix equally often: it takes no popularity or hot shift: %w", s.Order, ErrSpec)
	}
	w := &Workload{
		Kind:        Synthetic,
		Name:        syntheticName(s),
		BlockSize:   s.BlockSize,
		Seed:        s.Seed,
		Concurrency: s.Concurrency,
		Requests:    make([]Request, s.Requests),
		prefixes:    make([][]uint32, s.Prefixes),
		tails:       make([][]uint32, s.Requests),
	}
	// Separate streams: the prefixes do not change with the request count,
	// and the draws do not change with the token lengths.
	tailRng := rand.New(rand.NewPCG(s.Seed, 0x7461696c73))
	w.prefixes = prefixPool(s.Seed, s.Prefixes, s.PrefixTokens)
	if s.Agent.Turns > 0 {
		return newAgentSessions(w, s, zipf, tailRng)
	}
	if len(s.Tenants) > 0 {
		return newTenantStreams(w, s, zipf), nil
	}
	order := prefixOrder(s, zipf, s.Requests)
	for i := range w.Requests {
		k := order[i]
		w.tails[i] = randomTokens(tailRng, s.TailTokens)
		w.Requests[i] = independentRequest(s, fmt.Sprintf("r%d", i), k)
	}
	if s.ArrivalRate > 0 {
		w.OpenLoop, w.ArrivalRate = true, s.ArrivalRate
		for i, at := range Arrivals(s.Requests, s.ArrivalRate, s.ArrivalCV, s.Seed) {
			w.Requests[i].At = at
		}
	}
	w.hashAll()
	return w, nil
}

// independentRequest is request id of a synthetic workload of independent
// requests (no session) on prefix k; At is the caller's.
func independentRequest(s SyntheticSpec, id string, k int) Request {
	return Request{
		ID:           id,
		PromptTokens: s.PrefixTokens + s.TailTokens,
		OutputTokens: s.OutputTokens,
		Session:      NoSession,
		NextTurn:     -1,
		HitTokens:    hitTokens(s),
		Prefix:       k,
		SharedTokens: s.PrefixTokens,
	}
}

// hitTokens is a synthetic request's hit threshold: "covers at least half
// of the shared prefix"; a prefix-less workload counts any cached block.
func hitTokens(s SyntheticSpec) int { return max((s.PrefixTokens+1)/2, 1) }

// prefixPool is the n prefixes of tokens tokens each drawn from seed (the
// spec's, or with TenantPrefixesOwn a tenant's).
func prefixPool(seed uint64, n, tokens int) [][]uint32 {
	rng := rand.New(rand.NewPCG(seed, 0x7072656669786573))
	pool := make([][]uint32, n)
	for k := range pool {
		pool[k] = randomTokens(rng, tokens)
	}
	return pool
}

// prefixOrder draws the prefix of each of n requests (or sessions) by the
// spec's order and popularity, from the spec's seed.
func prefixOrder(s SyntheticSpec, zipf float64, n int) []int {
	drawRng := rand.New(rand.NewPCG(s.Seed, 0x6472617773))
	order := make([]int, n)
	var cdf []float64 // Zipf: cumulative probability of ranks 0…K−1
	if zipf > 0 {
		cdf = make([]float64, s.Prefixes)
		sum := 0.0
		for r := range cdf {
			sum += math.Pow(float64(r+1), -zipf)
			cdf[r] = sum
		}
		for r := range cdf {
			cdf[r] /= sum
		}
	}
	// perm deals popularity ranks to prefixes; HotShift re-deals it.
	perm := make([]int, s.Prefixes)
	for k := range perm {
		perm[k] = k
	}
	shiftRng := rand.New(rand.NewPCG(s.Seed, 0x686f747368696674))
	for i := range order {
		if s.HotShift > 0 && i > 0 && i%s.HotShift == 0 {
			shiftRng.Shuffle(len(perm), func(a, b int) { perm[a], perm[b] = perm[b], perm[a] })
		}
		switch {
		case s.Order == PrefixShuffled:
			order[i] = i % s.Prefixes
		case cdf != nil:
			r, _ := slices.BinarySearch(cdf, drawRng.Float64())
			order[i] = perm[min(r, s.Prefixes-1)]
		default:
			order[i] = perm[drawRng.IntN(s.Prefixes)]
		}
	}
	if s.Order == PrefixShuffled {
		drawRng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
	}
	return order
}

// Arrivals are the send times of n requests arriving at rate per second,
// the first at 0, with gamma-distributed gaps of mean 1/rate and
// coefficient of variation cv (0 or 1: exponential gaps, a Poisson
// process). The gaps are one seeded sequence of unit-mean draws divided by
// rate, so the same seed at another rate is the same arrival pattern
// stretched or squeezed: runs at neighbouring rates differ by the rate
// alone, which keeps a goodput search (attainment against rate) smooth.
func Arrivals(n int, rate, cv float64, seed uint64) []time.Duration {
	if cv == 0 {
		cv = 1
	}
	// Gamma with shape k has CV 1/sqrt(k); scale 1/k gives mean 1.
	k := 1 / (cv * cv)
	g := distuv.Gamma{Alpha: k, Beta: k, Src: rand.NewPCG(seed, 0x6172726976616c73)}
	out := make([]time.Duration, n)
	t := 0.0
	for i := range out {
		if i > 0 {
			t += g.Rand() / rate
		}
		out[i] = time.Duration(t * float64(time.Second))
	}
	return out
}

func randomTokens(rng *rand.Rand, n int) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = uint32(rng.IntN(Vocab))
	}
	return t
}

// Tokens appends request i's prompt token ids to dst[:0] and returns it.
// Traces store hash ids, not tokens, so prompts are materialised on demand.
func (w *Workload) Tokens(i int, dst []uint32) []uint32 {
	dst = dst[:0]
	switch {
	case w.prompts != nil:
		dst = append(dst, w.prompts[i]...)
	case w.Kind == Synthetic:
		dst = append(dst, w.prefixes[w.Requests[i].Prefix]...)
		dst = append(dst, w.tails[i]...)
	case w.Kind == Trace:
		dst = traceTokens(w.hashIDs[i], w.idTokens[i], w.Requests[i].PromptTokens, dst)
	}
	return dst
}

// hashAll computes every request's sequence hashes with the router's hashing,
// in parallel, into one backing array.
func (w *Workload) hashAll() {
	total := 0
	for _, r := range w.Requests {
		total += r.PromptTokens / w.BlockSize
	}
	backing := make([]uint64, total)
	off := 0
	for i := range w.Requests {
		n := w.Requests[i].PromptTokens / w.BlockSize
		w.Requests[i].Hashes = backing[off : off+n : off+n]
		off += n
	}
	workers := min(runtime.GOMAXPROCS(0), max(len(w.Requests)/64, 1))
	var wg sync.WaitGroup
	next := make(chan int, workers)
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var buf []uint32
			for i := range next {
				buf = w.Tokens(i, buf)
				copy(w.Requests[i].Hashes, router.SequenceHashes(buf, w.BlockSize, ""))
			}
		}()
	}
	for i := range w.Requests {
		next <- i
	}
	close(next)
	wg.Wait()
}

// PromptTokens is the sum of every request's prompt length.
func (w *Workload) PromptTokens() int64 {
	var n int64
	for _, r := range w.Requests {
		n += int64(r.PromptTokens)
	}
	return n
}

func syntheticName(s SyntheticSpec) string {
	name := fmt.Sprintf("synthetic prefixes=%d prefix_tokens=%d tail_tokens=%d", s.Prefixes, s.PrefixTokens, s.TailTokens)
	if s.Popularity != "" && s.Popularity != "uniform" {
		name += " popularity=" + s.Popularity
	}
	if s.HotShift > 0 {
		name += fmt.Sprintf(" hot_shift=%d", s.HotShift)
	}
	if a := s.Agent; a.Turns > 0 {
		name += fmt.Sprintf(" session_turns=%d think_time_ms=%g subagents=%d", a.Turns, float64(a.Think)/float64(time.Millisecond), a.Subagents)
	}
	if s.TenantPrefixes == TenantPrefixesOwn {
		name += " tenant_prefixes=own"
	}
	if s.ArrivalRate > 0 {
		name += fmt.Sprintf(" arrival_rate=%g", s.ArrivalRate)
		if s.ArrivalCV > 0 && s.ArrivalCV != 1 {
			name += fmt.Sprintf(" arrival_cv=%g", s.ArrivalCV)
		}
	}
	return name
}
