// Package capture records a replica's live traffic as a trace that kvbench
// replays: one JSON line per answered request in the Mooncake format
// (timestamp, input_length, output_length, hash_ids) that `kvbench sim
// --trace` reads, with a few fields of our own beside it. It holds no text
// and no token ids, only block hashes and lengths, so a capture can be
// shared without sharing prompts.
//
// hash_ids are the router's sequence hashes of the prompt's full blocks
// (block_tokens tokens each, the model's block size, where Mooncake's are
// 512 tokens), then one id for a partial last block. Sequence hashes are
// chained, so equal ids mean equal prefixes, as in Mooncake's traces, and a
// replay reproduces exactly which requests share which prefix. The partial
// block's id is derived from the last full block and the input length:
// engines never cache a partial block, so it only has to be unlikely to
// collide.
package capture

import (
	"fmt"
	"log/slog"
	"time"

	"github.com/kvrouter/kvrouter/internal/jsonlsink"
	"github.com/kvrouter/kvrouter/internal/splitmix"
)

// Row is one captured request.
type Row struct {
	// Timestamp is ms since the capture began (Mooncake's arrival time);
	// UnixMs is the same instant as Unix ms, so captures of several
	// replicas merge onto one time line (kvbench sim --trace a,b,c).
	Timestamp    float64  `json:"timestamp"`
	UnixMs       int64    `json:"unix_ms"`
	InputLength  int      `json:"input_length"`
	OutputLength int      `json:"output_length"`
	HashIDs      []uint64 `json:"hash_ids"`
	BlockTokens  int      `json:"block_tokens"`
	// OutputKnown is false when the engine reported no usage: the output
	// length is then what the client asked for (max_tokens), or 0.
	OutputKnown bool   `json:"output_known"`
	Sequences   int    `json:"n,omitempty"` // OpenAI's n, when above 1
	Model       string `json:"model,omitempty"`
	// Worker is the worker that answered; CachedTokens what its engine
	// reported as served from cache (usage), so a replay can be compared
	// with what the live fleet delivered.
	Worker       string `json:"worker,omitempty"`
	CachedTokens int    `json:"cached_tokens"`
	Replica      string `json:"replica,omitempty"`
}

// Request is what the api knows of an answered request.
type Request struct {
	Start        time.Time
	Model        string
	Hashes       []uint64 // sequence hashes of the prompt's full blocks
	BlockTokens  int      // the model's block size
	InputTokens  int
	OutputTokens int
	OutputKnown  bool
	Sequences    int
	Worker       string
	CachedTokens int
}

// Config says where and how much to capture.
type Config struct {
	Path string
	// Sample is the fraction of prefixes captured, in (0, 1]: a request is
	// kept when its first block's hash falls in the sample, so every
	// request that shares a first block with a kept one is kept too and a
	// replay sees the reuse the live fleet saw among them. Requests shorter
	// than one block are always kept.
	Sample   float64
	MaxBytes int64 // rotate past this size (≤ 0: 64 MiB); 3 old files kept
	Replica  string
}

// Recorder appends captured requests to a rotated JSON-lines file.
type Recorder struct {
	cfg       Config
	threshold uint64 // keep a first-block hash whose mix is below it
	all       bool
	origin    time.Time
	sink      *jsonlsink.Sink[Row]
}

// Open starts a capture at cfg.Path (appending to an existing file).
func Open(cfg Config, now time.Time, log *slog.Logger) (*Recorder, error) {
	if !(cfg.Sample > 0 && cfg.Sample <= 1) {
		return nil, fmt.Errorf("capture: sample %v must be in (0, 1]", cfg.Sample)
	}
	sink, err := jsonlsink.Open[Row](cfg.Path, "capture", cfg.MaxBytes, 3, log)
	if err != nil {
		return nil, err
	}
	r := &Recorder{cfg: cfg, origin: now, sink: sink, all: cfg.Sample >= 1}
	if !r.all {
		r.threshold = uint64(cfg.Sample * (1 << 63) * 2)
	}
	return r, nil
}

// Keep says whether a prompt whose first full block has hash first (false:
// no full block) is in the sample.
func (r *Recorder) Keep(first uint64, hasBlock bool) bool {
	return r.all || !hasBlock || splitmix.Mix(first) < r.threshold
}

// Record queues one answered request (dropped, and counted, when the
// writer is behind; never blocks).
func (r *Recorder) Record(q Request) {
	if len(q.Hashes) > 0 && !r.Keep(q.Hashes[0], true) {
		return
	}
	ids := make([]uint64, len(q.Hashes), len(q.Hashes)+1)
	copy(ids, q.Hashes)
	if q.BlockTokens > 0 && q.InputTokens > len(q.Hashes)*q.BlockTokens {
		ids = append(ids, partialBlockID(q))
	}
	row := &Row{
		Timestamp:    float64(q.Start.Sub(r.origin).Microseconds()) / 1000,
		UnixMs:       q.Start.UnixMilli(),
		InputLength:  q.InputTokens,
		OutputLength: q.OutputTokens,
		HashIDs:      ids,
		BlockTokens:  q.BlockTokens,
		OutputKnown:  q.OutputKnown,
		Model:        q.Model,
		Worker:       q.Worker,
		CachedTokens: q.CachedTokens,
		Replica:      r.cfg.Replica,
	}
	if row.Timestamp < 0 {
		row.Timestamp = 0
	}
	if q.Sequences > 1 {
		row.Sequences = q.Sequences
	}
	r.sink.Write(row)
}

// Close writes what is queued and closes the file.
func (r *Recorder) Close() error { return r.sink.Close() }

// Dropped is how many rows the writer's full queue turned away.
func (r *Recorder) Dropped() uint64 { return r.sink.Dropped() }

// Written is how many rows reached the file.
func (r *Recorder) Written() uint64 { return r.sink.Written() }

// partialBlockID is the id of q's partial last block: the last full
// block's hash mixed with the input length.
func partialBlockID(q Request) uint64 {
	var last uint64
	if len(q.Hashes) > 0 {
		last = q.Hashes[len(q.Hashes)-1]
	}
	return splitmix.Mix(last ^ uint64(q.InputTokens)<<1 ^ 0x7061727469616c)
}
