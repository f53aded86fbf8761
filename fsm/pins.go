package fsm

import (
	"cmp"
	"container/heap"
	"encoding/binary"
	"fmt"
	"slices"
	"strings"

	"github.com/kvrouter/kvrouter/router"
)

// Prefix pins (issue 28 item 2, DESIGN.md "Prefix pins"): Dynamo's agentic
// cache control (nvext.cache_control {"type": "ephemeral", "ttl": "5m"}).
// A pin holds a prompt prefix — its block hashes as the router computed
// them — on the worker (rank) that served it until an idle expiry. While it
// lasts every replica sends requests starting with that prefix to its
// holders and kv-pooled counts its blocks as held and not evictable. Pins
// live in the control group's FSM beside session bindings, for the same
// reasons (read on every request by every replica, written rarely).

// Pin limits: constants of the build (replicas must decide alike).
const (
	// MaxPins bounds the pins the state holds; a new pin beyond is refused
	// (ErrPinLimit) and the request served unpinned. A pin holds KV memory
	// on a worker, so the useful number is what a fleet can hold pinned:
	// 1,024 pins of a typical agent context (10–30k tokens, ~1–2k blocks)
	// are 1–2 M blocks, the whole cache of a dozen large workers. The bound
	// also caps the state: 1,024 × MaxPinBlocks hashes is 32 MiB at most.
	MaxPins = 1024
	// MaxPinBlocks bounds the blocks of one pin (64k tokens at block size
	// 16, 256k at 64): a longer prompt pins its first MaxPinBlocks blocks,
	// still a prefix. An entry carrying a pin is at most 32 KiB of hashes.
	MaxPinBlocks = 4096
	// MinPinTTL and MaxPinTTL bound a pin's TTL: Dynamo's formats run from
	// seconds to "1h", Anthropic's longest cache TTL.
	MinPinTTL = nanosPerSecond
	MaxPinTTL = 3600 * nanosPerSecond
)

// ErrPinLimit refuses a new pin while MaxPins are held. It wraps
// ErrInvalidCommand (a domain error); the request is served unpinned.
var ErrPinLimit = fmt.Errorf("prefix pins full: %w", ErrInvalidCommand)

// PinPrefix (command 19) pins a prefix on a worker rank until Until (unix
// nanos: the proposer's clock + TTL), or refreshes the pin. A pin is named
// by (Model, Key, Worker), Key being the hash of the prefix's last block:
// block hashes are sequence hashes, so the last one names the whole
// prefix. On apply:
//   - the pin exists: a refresh, Until = max(old, new) (never shortened);
//   - it does not and Blocks is empty (a refresh of a pin that expired or
//     moved meanwhile): nothing, Applied 0;
//   - else a new pin of Blocks; pins of the same model on the same worker
//     whose key is one of Blocks (shorter prefixes of the same prompt)
//     end: the new one covers them, so a conversation holds one pin.
//
// Replace names a holder the proposer found gone: its pins of the prefix
// (of Model, keyed by any of Blocks: the prefix or a shorter one) end in
// the same entry — the pin moves to Worker.
type PinPrefix struct {
	Model   string
	Worker  router.WorkerID // router key: router.WorkerKey(id, rank)
	Key     uint64          // the prefix's last block hash (Blocks[len-1])
	Blocks  []uint64        // the prefix, 1..MaxPinBlocks; nil: a refresh
	TTL     int64           // nanos, MinPinTTL..MaxPinTTL: what a refresh extends by
	Until   int64           // unix nanos, > 0
	Replace router.WorkerID // "" = none; only with Blocks
}

// UnpinPrefix (command 20) ends pins: with Model, those of the prefix Key
// on Worker's ranks (every holder when Worker is ""); without, every pin
// on Worker's ranks. Ending what is not pinned succeeds with Applied 0.
// Expiry needs no command: a Tick ends what is due.
type UnpinPrefix struct {
	Model  string
	Key    uint64
	Worker string // a worker id (no '#'): all its ranks
}

func (PinPrefix) Type() CommandType   { return CmdPinPrefix }
func (UnpinPrefix) Type() CommandType { return CmdUnpinPrefix }

// Pin is one pin as the state holds it.
type Pin struct {
	Model  string          `json:"model"`
	Worker router.WorkerID `json:"worker"`
	Blocks []uint64        `json:"-"`
	TTL    int64           `json:"ttl"`   // nanos
	Until  int64           `json:"until"` // unix nanos: idle expiry (the FSM's clock decides)
}

// Key is the hash of the pin's last block, which names the prefix.
func (p *Pin) Key() uint64 { return p.Blocks[len(p.Blocks)-1] }

// pinKey names a pinned prefix; pins[pinKey] holds its holders.
type pinKey struct {
	model string
	key   uint64
}

// pinnedKey names one worker's pinned blocks of a model.
type pinnedKey struct {
	model  string
	worker router.WorkerID
}

// Validate checks the command's own fields (the limit and the clock are
// checked on apply; FSM.CheckPinPrefix checks all).
func (c PinPrefix) Validate() error {
	if c.Model == "" {
		return fmt.Errorf("pin prefix: empty model: %w", ErrInvalidCommand)
	}
	if err := checkString("pin prefix: model", c.Model); err != nil {
		return err
	}
	if err := checkBindingWorker("pin prefix: worker", c.Worker); err != nil {
		return err
	}
	switch n := len(c.Blocks); {
	case n > MaxPinBlocks:
		return fmt.Errorf("pin prefix: %d blocks, limit %d: %w", n, MaxPinBlocks, ErrInvalidCommand)
	case n > 0 && c.Blocks[n-1] != c.Key:
		return fmt.Errorf("pin prefix: key %x is not the last block %x: %w", c.Key, c.Blocks[n-1], ErrInvalidCommand)
	case n == 0 && c.Replace != "":
		return fmt.Errorf("pin prefix: a move (replace %q) must carry the prefix: %w", c.Replace, ErrInvalidCommand)
	}
	if c.Replace != "" {
		if err := checkBindingWorker("pin prefix: replaced worker", c.Replace); err != nil {
			return err
		}
		if c.Replace == c.Worker {
			return fmt.Errorf("pin prefix: replaces its own worker %q: %w", c.Worker, ErrInvalidCommand)
		}
	}
	if c.TTL < MinPinTTL || c.TTL > MaxPinTTL {
		return fmt.Errorf("pin prefix: ttl %s outside [%s, %s]: %w", fmtNanos(c.TTL), fmtNanos(MinPinTTL), fmtNanos(MaxPinTTL), ErrInvalidCommand)
	}
	if c.Until <= 0 {
		return fmt.Errorf("pin prefix: until %d must be a positive unix-nano time: %w", c.Until, ErrInvalidCommand)
	}
	return nil
}

// Validate checks the forms: a model's prefix (on a worker or every
// holder), or every pin of a worker.
func (c UnpinPrefix) Validate() error {
	switch {
	case c.Model == "" && c.Worker == "":
		return fmt.Errorf("unpin prefix: neither model nor worker: %w", ErrInvalidCommand)
	case c.Model == "" && c.Key != 0:
		return fmt.Errorf("unpin prefix: key %x without a model: %w", c.Key, ErrInvalidCommand)
	case strings.ContainsRune(c.Worker, '#'):
		return fmt.Errorf("unpin prefix of worker %q: '#' is reserved for dp ranks: %w", c.Worker, ErrInvalidCommand)
	}
	if err := checkString("unpin prefix: model", c.Model); err != nil {
		return err
	}
	return checkString("unpin prefix: worker id", c.Worker)
}

func appendPinPrefix(b []byte, c *PinPrefix) ([]byte, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	b = appendString(b, c.Model)
	b = appendString(b, string(c.Worker))
	b = appendU64(b, c.Key)
	b = binary.AppendUvarint(b, uint64(len(c.Blocks)))
	for _, h := range c.Blocks {
		b = appendU64(b, h)
	}
	b = binary.AppendVarint(b, c.TTL)
	b = binary.AppendVarint(b, c.Until)
	return appendString(b, string(c.Replace)), nil
}

func readPinPrefix(r *reader) PinPrefix {
	c := PinPrefix{Model: r.string("model"), Worker: router.WorkerID(r.string("worker")), Key: r.u64()}
	if n := r.count("pinned blocks", 8); n > 0 {
		if n > MaxPinBlocks {
			r.fail("%d pinned blocks, limit %d", n, MaxPinBlocks)
			return c
		}
		c.Blocks = make([]uint64, n)
		for i := range c.Blocks {
			c.Blocks[i] = r.u64()
		}
	}
	c.TTL, c.Until = r.varint(), r.varint()
	c.Replace = router.WorkerID(r.string("replaced worker"))
	return c
}

func appendUnpinPrefix(b []byte, c *UnpinPrefix) ([]byte, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return appendString(appendU64(appendString(b, c.Model), c.Key), c.Worker), nil
}

func readUnpinPrefix(r *reader) UnpinPrefix {
	return UnpinPrefix{Model: r.string("model"), Key: r.u64(), Worker: r.string("worker id")}
}

// EncodePinPrefix and EncodeUnpinPrefix refuse what Validate refuses.
func EncodePinPrefix(c PinPrefix) ([]byte, error)        { return Encode(c) }
func EncodeUnpinPrefix(c UnpinPrefix) ([]byte, error)    { return Encode(c) }
func DecodePinPrefix(data []byte) (PinPrefix, error)     { return decodeAs[PinPrefix](data) }
func DecodeUnpinPrefix(data []byte) (UnpinPrefix, error) { return decodeAs[UnpinPrefix](data) }

// pinEntry is one expiry in the pin heap, stale once the pin was refreshed
// or ended. Ordered by until, model, key, worker: one pop order everywhere.
type pinEntry struct {
	until  int64
	model  string
	key    uint64
	worker router.WorkerID
}

type pinHeap []pinEntry

func (h pinHeap) Len() int { return len(h) }
func (h pinHeap) Less(i, j int) bool {
	a, b := h[i], h[j]
	if c := cmp.Compare(a.until, b.until); c != 0 {
		return c < 0
	}
	if c := strings.Compare(a.model, b.model); c != 0 {
		return c < 0
	}
	if a.key != b.key {
		return a.key < b.key
	}
	return a.worker < b.worker
}
func (h pinHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *pinHeap) Push(x any)   { *h = append(*h, x.(pinEntry)) }
func (h *pinHeap) Pop() any {
	s := *h
	e := s[len(s)-1]
	*h = s[:len(s)-1]
	return e
}

func (st *state) pinEntryLive(e pinEntry) bool {
	p := st.pins[pinKey{e.model, e.key}][e.worker]
	return p != nil && p.Until == e.until
}

// earliestPinLocked is the earliest live pin expiry (0: none), popping
// stale entries off the top. f.mu held for writing.
func (st *state) earliestPinLocked() int64 {
	for st.pinHeap.Len() > 0 {
		if e := st.pinHeap[0]; st.pinEntryLive(e) {
			return e.until
		}
		heap.Pop(&st.pinHeap)
	}
	return 0
}

// addPinLocked stores p (not held yet) and its derived state.
func (st *state) addPinLocked(p *Pin) {
	k := pinKey{p.Model, p.Key()}
	m := st.pins[k]
	if m == nil {
		m = make(map[router.WorkerID]*Pin, 1)
		st.pins[k] = m
	}
	m[p.Worker] = p
	st.pinCount++
	st.pinFirst[p.Blocks[0]] = append(st.pinFirst[p.Blocks[0]], p)
	pk := pinnedKey{p.Model, p.Worker}
	blocks := st.pinned[pk]
	if blocks == nil {
		blocks = make(map[uint64]int32, len(p.Blocks))
		st.pinned[pk] = blocks
	}
	for _, h := range p.Blocks {
		blocks[h]++
	}
	heap.Push(&st.pinHeap, pinEntry{until: p.Until, model: p.Model, key: k.key, worker: p.Worker})
}

// removePinLocked ends the pin (model, key) of worker w, if held; its heap
// entry goes stale.
func (st *state) removePinLocked(model string, key uint64, w router.WorkerID) bool {
	k := pinKey{model, key}
	p := st.pins[k][w]
	if p == nil {
		return false
	}
	delete(st.pins[k], w)
	if len(st.pins[k]) == 0 {
		delete(st.pins, k)
	}
	st.pinCount--
	first := st.pinFirst[p.Blocks[0]]
	if first = slices.DeleteFunc(first, func(q *Pin) bool { return q == p }); len(first) == 0 {
		delete(st.pinFirst, p.Blocks[0])
	} else {
		st.pinFirst[p.Blocks[0]] = first
	}
	pk := pinnedKey{model, w}
	blocks := st.pinned[pk]
	for _, h := range p.Blocks {
		if blocks[h]--; blocks[h] <= 0 {
			delete(blocks, h)
		}
	}
	if len(blocks) == 0 {
		delete(st.pinned, pk)
	}
	return true
}

// pinPlan is what a PinPrefix would do: refresh the pin held, create one
// (ending superseded and replaced pins), or nothing.
type pinPlan struct {
	held       *Pin
	superseded []uint64 // keys of the worker's shorter pins of the prompt
	replaced   []uint64 // keys of Replace's pins of the prompt
}

// planPinLocked checks c against the state and says what applying it does,
// or the domain error that refuses it (the state unchanged). f.mu held
// (read is enough).
func (st *state) planPinLocked(c PinPrefix) (pinPlan, error) {
	var plan pinPlan
	if err := c.Validate(); err != nil {
		return plan, err
	}
	if c.Until <= st.lastTick {
		return plan, fmt.Errorf("pin prefix: until %d is not after the clock %d: %w", c.Until, st.lastTick, ErrInvalidCommand)
	}
	plan.held = st.pins[pinKey{c.Model, c.Key}][c.Worker]
	if plan.held != nil || len(c.Blocks) == 0 {
		return plan, nil
	}
	for _, h := range c.Blocks[:len(c.Blocks)-1] {
		if st.pins[pinKey{c.Model, h}][c.Worker] != nil {
			plan.superseded = append(plan.superseded, h)
		}
	}
	if c.Replace != "" {
		for _, h := range c.Blocks {
			if st.pins[pinKey{c.Model, h}][c.Replace] != nil {
				plan.replaced = append(plan.replaced, h)
			}
		}
	}
	freed := len(plan.superseded) + len(plan.replaced)
	if st.pinCount-freed >= MaxPins {
		return plan, fmt.Errorf("pin prefix %x of %q: %d pins held: %w", c.Key, c.Model, st.pinCount, ErrPinLimit)
	}
	return plan, nil
}

// pinLocked applies PinPrefix. f.mu held.
func (f *FSM) pinLocked(c PinPrefix, res *ApplyResult) error {
	st := f.st
	plan, err := st.planPinLocked(c)
	if err != nil {
		return err
	}
	until := c.Until
	if ref := max(st.lastTick, st.earliestExpiryLocked()); ref > 0 && until > addSat(ref, MaxPinTTL) {
		until, res.Clamped = addSat(ref, MaxPinTTL), true
	}
	switch {
	case plan.held != nil:
		if until > plan.held.Until {
			plan.held.Until = until
			heap.Push(&st.pinHeap, pinEntry{until: until, model: c.Model, key: c.Key, worker: c.Worker})
		}
		res.Applied = 1
	case len(c.Blocks) == 0:
		// A refresh of a pin no longer held: nothing to refresh.
	default:
		for _, k := range plan.superseded {
			st.removePinLocked(c.Model, k, c.Worker)
		}
		for _, k := range plan.replaced {
			st.removePinLocked(c.Model, k, c.Replace)
		}
		st.addPinLocked(&Pin{Model: c.Model, Worker: c.Worker, Blocks: slices.Clone(c.Blocks), TTL: c.TTL, Until: until})
		res.Applied = 1
	}
	return nil
}

// unpinLocked applies UnpinPrefix. f.mu held.
func (f *FSM) unpinLocked(c UnpinPrefix, res *ApplyResult) error {
	if err := c.Validate(); err != nil {
		return err
	}
	st := f.st
	type victim struct {
		model string
		key   uint64
		w     router.WorkerID
	}
	var out []victim
	if c.Model != "" {
		for w := range st.pins[pinKey{c.Model, c.Key}] {
			if c.Worker == "" || workerOfKey(w) == c.Worker {
				out = append(out, victim{c.Model, c.Key, w})
			}
		}
	} else {
		for k, m := range st.pins {
			for w := range m {
				if workerOfKey(w) == c.Worker {
					out = append(out, victim{k.model, k.key, w})
				}
			}
		}
	}
	// Removal order cannot show (only the set is state).
	for _, v := range out {
		st.removePinLocked(v.model, v.key, v.w)
	}
	res.Applied = len(out)
	return nil
}

// expirePinsLocked ends the pins whose expiry is at or before now (a
// Tick). f.mu held.
func (f *FSM) expirePinsLocked(now int64) int {
	st := f.st
	n := 0
	for st.pinHeap.Len() > 0 && st.pinHeap[0].until <= now {
		e := heap.Pop(&st.pinHeap).(pinEntry)
		if st.pinEntryLive(e) {
			st.removePinLocked(e.model, e.key, e.worker)
			n++
		}
	}
	return n
}

// PinLookup finds the longest pinned prefix of hashes (a request's block
// hashes) for model: its length in blocks and its holders, sorted by
// worker (copies). depth 0: none. A local read, no consensus: the pins
// starting with the prompt's first block are compared with it, a pin of d
// blocks matching when the prompt's d-th hash is its key (sequence hashes:
// equal d-th hashes mean equal prefixes).
func (f *FSM) PinLookup(model string, hashes []uint64) (depth int, holders []Pin) {
	if len(hashes) == 0 {
		return 0, nil
	}
	f.mu.RLock()
	defer f.mu.RUnlock()
	for _, p := range f.st.pinFirst[hashes[0]] {
		d := len(p.Blocks)
		if d < depth || d > len(hashes) || p.Model != model || hashes[d-1] != p.Key() {
			continue
		}
		if d > depth {
			depth, holders = d, holders[:0]
		}
		holders = append(holders, Pin{Model: p.Model, Worker: p.Worker, Blocks: p.Blocks, TTL: p.TTL, Until: p.Until})
	}
	slices.SortFunc(holders, func(a, b Pin) int { return strings.Compare(string(a.Worker), string(b.Worker)) })
	return depth, holders
}

// PinnedBlocks is the number of distinct blocks of model pinned on worker
// w (a router key): what kv-pooled counts as held and not evictable.
func (f *FSM) PinnedBlocks(model string, w router.WorkerID) int {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return len(f.st.pinned[pinnedKey{model, w}])
}

// PinCount is the number of pins held.
func (f *FSM) PinCount() int {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.st.pinCount
}

// Pins lists every pin, sorted by model, worker, then key. Blocks are
// shared with the state: read only.
func (f *FSM) Pins() []Pin {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make([]Pin, 0, f.st.pinCount)
	for _, m := range f.st.pins {
		for _, p := range m {
			out = append(out, *p)
		}
	}
	slices.SortFunc(out, comparePins)
	return out
}

func comparePins(a, b Pin) int {
	return cmp.Or(strings.Compare(a.Model, b.Model), strings.Compare(string(a.Worker), string(b.Worker)), cmp.Compare(a.Key(), b.Key()))
}

// PinsPerWorker counts the pins per worker id (all its ranks).
func (f *FSM) PinsPerWorker() map[string]int {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make(map[string]int)
	for _, m := range f.st.pins {
		for w := range m {
			out[workerOfKey(w)]++
		}
	}
	return out
}

// CheckPinPrefix returns the error apply would give c now, or nil.
func (f *FSM) CheckPinPrefix(c PinPrefix) error {
	f.mu.RLock()
	defer f.mu.RUnlock()
	_, err := f.st.planPinLocked(c)
	return err
}

// Snapshot side: pins are record recPin (format 8), sorted by model,
// worker, key.

func (img *image) capturePins(st *state) {
	for _, m := range st.pins {
		for _, p := range m {
			img.pins = append(img.pins, *p) // Blocks never change in place: sharing is safe
		}
	}
	slices.SortFunc(img.pins, comparePins)
}

func appendPinRecord(b []byte, p *Pin) []byte {
	b = appendString(b, p.Model)
	b = appendString(b, string(p.Worker))
	b = binary.AppendVarint(b, p.TTL)
	b = binary.AppendVarint(b, p.Until)
	b = binary.AppendUvarint(b, uint64(len(p.Blocks)))
	for _, h := range p.Blocks {
		b = appendU64(b, h)
	}
	return b
}

// readPinRecord reads and checks one pin of a snapshot.
func readPinRecord(st *state, rd *reader) error {
	p := &Pin{Model: rd.string("model"), Worker: router.WorkerID(rd.string("worker")), TTL: rd.varint(), Until: rd.varint()}
	n := rd.count("pinned blocks", 8)
	if rd.err != nil {
		return nil // reported by rd.done
	}
	if n == 0 || n > MaxPinBlocks {
		return corrupt("pin of %q on %q: %d blocks", p.Model, p.Worker, n)
	}
	p.Blocks = make([]uint64, n)
	for i := range p.Blocks {
		p.Blocks[i] = rd.u64()
	}
	if rd.err != nil {
		return nil
	}
	c := PinPrefix{Model: p.Model, Worker: p.Worker, Key: p.Key(), Blocks: p.Blocks, TTL: p.TTL, Until: p.Until}
	if err := c.Validate(); err != nil {
		return corrupt("pin: %v", err)
	}
	if st.pins[pinKey{p.Model, p.Key()}][p.Worker] != nil || p.Until <= st.lastTick || st.pinCount >= MaxPins {
		return corrupt("pin %x of %q on %q repeated, expired by the clock, or beyond %d pins", p.Key(), p.Model, p.Worker, MaxPins)
	}
	st.addPinLocked(p)
	return nil
}
