package workload

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/internal/splitmix"
)

// TraceBlockTokens is the Mooncake traces' hash-id granularity.
const TraceBlockTokens = 512

// Limits on one trace row. They keep a corrupt or hostile line from asking
// for absurd amounts of memory or overflowing virtual time.
const (
	MaxTraceTokens      = 1 << 24 // input or output tokens of one request
	MaxTraceTimestampMs = 1e12    // about 31 years
)

// TraceRow is one parsed line of a Mooncake trace.
type TraceRow struct {
	TimestampMs  float64
	InputLength  int
	OutputLength int
	HashIDs      []uint64
	// BlockTokens is the tokens each hash id stands for: 512 in Mooncake's
	// traces, the model's block size in a kvrouter capture (block_tokens).
	BlockTokens int
	// UnixMs is the arrival as Unix ms (unix_ms, 0 when absent): captures
	// of several replicas carry it, and are merged onto one time line by it.
	UnixMs int64
	// CachedTokens is what the live engine reported as served from cache
	// (cached_tokens, a kvrouter capture's); HasCached says the row had it.
	CachedTokens int
	HasCached    bool
	// SessionID is the row's session_id (a string, or an integer spelled
	// in decimal); HasSession says whether the row had one.
	SessionID  string
	HasSession bool
	// ThinkMs is a session turn's think time (think_ms, optional, ms): the
	// pause between the end of the session's previous turn and this one,
	// as an agent's tool call or a user's reading (kvbench agents writes
	// it). 0: the turn follows at once (or at its timestamp).
	ThinkMs float64
}

// ErrTraceLine marks a malformed trace line.
var ErrTraceLine = errors.New("malformed trace line")

type rawRow struct {
	Timestamp    *float64        `json:"timestamp"`
	InputLength  *int64          `json:"input_length"`
	OutputLength *int64          `json:"output_length"`
	HashIDs      *[]uint64       `json:"hash_ids"`
	BlockTokens  *int64          `json:"block_tokens"`
	UnixMs       *int64          `json:"unix_ms"`
	CachedTokens *int64          `json:"cached_tokens"`
	SessionID    json.RawMessage `json:"session_id"`
	ThinkMs      *float64        `json:"think_ms"`
}

// ParseTraceLine parses and checks one JSON line of a Mooncake trace:
// timestamp (ms, ≥ 0), input_length (≥ 1), output_length (≥ 0), hash_ids
// (one per 512 tokens of input, the last one partial, or one per
// block_tokens tokens when the line says so, as kvrouter's captures do),
// an optional unix_ms (≥ 0), an optional session_id (string or
// integer) and an optional think_ms (≥ 0). Unknown fields are ignored.
func ParseTraceLine(line []byte) (TraceRow, error) {
	var raw rawRow
	if err := json.Unmarshal(line, &raw); err != nil {
		return TraceRow{}, fmt.Errorf("%w: %v", ErrTraceLine, err)
	}
	var row TraceRow
	switch {
	case raw.Timestamp == nil:
		return row, fmt.Errorf("%w: missing timestamp", ErrTraceLine)
	case raw.InputLength == nil:
		return row, fmt.Errorf("%w: missing input_length", ErrTraceLine)
	case raw.OutputLength == nil:
		return row, fmt.Errorf("%w: missing output_length", ErrTraceLine)
	case raw.HashIDs == nil:
		return row, fmt.Errorf("%w: missing hash_ids", ErrTraceLine)
	}
	ts, in, out := *raw.Timestamp, *raw.InputLength, *raw.OutputLength
	switch {
	case math.IsNaN(ts) || ts < 0 || ts > MaxTraceTimestampMs:
		return row, fmt.Errorf("%w: timestamp %v outside [0, %g] ms", ErrTraceLine, ts, MaxTraceTimestampMs)
	case in < 1 || in > MaxTraceTokens:
		return row, fmt.Errorf("%w: input_length %d outside [1, %d]", ErrTraceLine, in, MaxTraceTokens)
	case out < 0 || out > MaxTraceTokens:
		return row, fmt.Errorf("%w: output_length %d outside [0, %d]", ErrTraceLine, out, MaxTraceTokens)
	}
	bt := int64(TraceBlockTokens)
	if raw.BlockTokens != nil {
		if bt = *raw.BlockTokens; bt < 1 || bt > MaxTraceTokens {
			return row, fmt.Errorf("%w: block_tokens %d outside [1, %d]", ErrTraceLine, bt, MaxTraceTokens)
		}
	}
	var unix int64
	if raw.UnixMs != nil {
		if unix = *raw.UnixMs; unix < 0 {
			return row, fmt.Errorf("%w: unix_ms %d is negative", ErrTraceLine, unix)
		}
	}
	ids := *raw.HashIDs
	if want := (in + bt - 1) / bt; int64(len(ids)) != want {
		return row, fmt.Errorf("%w: %d hash_ids for input_length %d (want %d, one per %d tokens)",
			ErrTraceLine, len(ids), in, want, bt)
	}
	row = TraceRow{TimestampMs: ts, InputLength: int(in), OutputLength: int(out), HashIDs: ids, BlockTokens: int(bt), UnixMs: unix}
	if c := raw.CachedTokens; c != nil {
		if *c < 0 || *c > in {
			return TraceRow{}, fmt.Errorf("%w: cached_tokens %d outside [0, input_length %d]", ErrTraceLine, *c, in)
		}
		row.CachedTokens, row.HasCached = int(*c), true
	}
	if s := bytes.TrimSpace(raw.SessionID); len(s) > 0 && !bytes.Equal(s, []byte("null")) {
		id, err := parseSessionID(s)
		if err != nil {
			return TraceRow{}, err
		}
		row.SessionID, row.HasSession = id, true
	}
	if t := raw.ThinkMs; t != nil {
		if math.IsNaN(*t) || *t < 0 || *t > MaxTraceTimestampMs {
			return TraceRow{}, fmt.Errorf("%w: think_ms %v outside [0, %g]", ErrTraceLine, *t, MaxTraceTimestampMs)
		}
		row.ThinkMs = *t
	}
	return row, nil
}

func parseSessionID(s []byte) (string, error) {
	if s[0] == '"' {
		var id string
		if err := json.Unmarshal(s, &id); err != nil {
			return "", fmt.Errorf("%w: session_id: %v", ErrTraceLine, err)
		}
		return id, nil
	}
	if n, err := strconv.ParseInt(string(s), 10, 64); err == nil {
		return strconv.FormatInt(n, 10), nil
	}
	return "", fmt.Errorf("%w: session_id %s is neither a string nor an integer", ErrTraceLine, s)
}

// TraceSpec says how to replay a trace file.
type TraceSpec struct {
	// Path is a trace file, or several separated by commas (the captures
	// of several replicas): their rows are replayed together, on one time
	// line by unix_ms when every row has it, else by timestamp.
	Path        string
	Speedup     float64 // arrival times are divided by it
	MaxRequests int     // 0 = all rows
	BlockSize   int
}

// LoadTrace reads a Mooncake trace. A malformed line is an error naming
// file:line. Requests are ordered by arrival (file order among equal
// timestamps); a session's turns keep their file order.
func LoadTrace(s TraceSpec) (*Workload, error) {
	if s.BlockSize <= 0 {
		return nil, fmt.Errorf("block size %d: %w", s.BlockSize, ErrSpec)
	}
	if !(s.Speedup > 0) || math.IsInf(s.Speedup, 0) {
		return nil, fmt.Errorf("speedup %v must be a positive number: %w", s.Speedup, ErrSpec)
	}
	var rows []TraceRow
	var names []string
	for _, path := range strings.Split(s.Path, ",") {
		more, err := readTraceFile(path, s.MaxRequests)
		if err != nil {
			return nil, err
		}
		rows = append(rows, more...)
		name := filepath.Base(path)
		if strings.Contains(s.Path, ",") { // captures are often r1/capture.jsonl, r2/capture.jsonl, …
			name = filepath.Join(filepath.Base(filepath.Dir(path)), name)
		}
		names = append(names, name)
	}
	if len(rows) == 0 {
		return nil, fmt.Errorf("%s: no requests: %w", s.Path, ErrSpec)
	}
	rebaseUnix(rows)
	if s.MaxRequests > 0 && len(rows) > s.MaxRequests {
		// Several files: the first MaxRequests arrivals of all of them.
		slices.SortStableFunc(rows, func(a, b TraceRow) int { return cmp.Compare(a.TimestampMs, b.TimestampMs) })
		rows = rows[:s.MaxRequests]
	}
	return fromRows(rows, s, strings.Join(names, "+")), nil
}

func readTraceFile(path string, max int) ([]TraceRow, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return ReadTrace(f, path, max)
}

// rebaseUnix puts rows that all carry unix_ms on one time line starting at
// 0 (the captures of several replicas each count timestamp from their own
// start).
func rebaseUnix(rows []TraceRow) {
	first := int64(math.MaxInt64)
	for _, r := range rows {
		if r.UnixMs <= 0 {
			return
		}
		first = min(first, r.UnixMs)
	}
	for i := range rows {
		rows[i].TimestampMs = float64(rows[i].UnixMs - first)
	}
}

// ReadTrace parses up to max rows (0 = all) from r; name is used in errors
// ("name:line: …"). Blank lines are skipped.
func ReadTrace(r io.Reader, name string, max int) ([]TraceRow, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 1<<16), 64<<20)
	var rows []TraceRow
	for n := 1; sc.Scan(); n++ {
		line := bytes.TrimSpace(sc.Bytes())
		if len(line) == 0 {
			continue
		}
		row, err := ParseTraceLine(line)
		if err != nil {
			return nil, fmt.Errorf("%s:%d: %w", name, n, err)
		}
		rows = append(rows, row)
		if max > 0 && len(rows) == max {
			return rows, nil
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return rows, nil
}

func fromRows(rows []TraceRow, s TraceSpec, name string) *Workload {
	order := make([]int, len(rows))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(rows[a].TimestampMs, rows[b].TimestampMs) })
	w := &Workload{
		Kind:      Trace,
		Name:      name,
		BlockSize: s.BlockSize,
		Requests:  make([]Request, len(rows)),
		hashIDs:   make([][]uint64, len(rows)),
		idTokens:  make([]int, len(rows)),
	}
	sessions := map[string]int{}
	for i, j := range order {
		row := rows[j]
		sess := NoSession
		if row.HasSession {
			k, ok := sessions[row.SessionID]
			if !ok {
				k = len(w.Sessions)
				sessions[row.SessionID] = k
				w.Sessions = append(w.Sessions, nil)
			}
			if turns := w.Sessions[k]; len(turns) > 0 {
				prev := &w.Requests[turns[len(turns)-1]]
				prev.NextTurn = i
				// The row's think_ms is the pause after the previous turn.
				prev.Think = time.Duration(row.ThinkMs / s.Speedup * float64(time.Millisecond))
			}
			w.Sessions[k] = append(w.Sessions[k], i)
			sess = k
		}
		w.hashIDs[i] = row.HashIDs
		w.idTokens[i] = cmp.Or(row.BlockTokens, TraceBlockTokens)
		w.Requests[i] = Request{
			NextTurn:     -1,
			ID:           fmt.Sprintf("t%d", i),
			PromptTokens: row.InputLength,
			OutputTokens: max(row.OutputLength, 1), // an engine emits at least one token
			At:           time.Duration(row.TimestampMs / s.Speedup * float64(time.Millisecond)),
			Session:      sess,
			HitTokens:    s.BlockSize,
			Prefix:       -1,
		}
	}
	w.hashAll()
	w.Live = liveFigures(rows, s.BlockSize)
	return w
}

// liveFigures are a capture's own figures, when every row says what its
// engine served from cache: over all rows, as the simulator's are.
func liveFigures(rows []TraceRow, blockSize int) *Live {
	var l Live
	var cached, prompt int64
	hits := 0
	for _, r := range rows {
		if !r.HasCached {
			return nil
		}
		cached += int64(r.CachedTokens)
		prompt += int64(r.InputLength)
		if r.CachedTokens >= blockSize {
			hits++
		}
	}
	l.Requests = len(rows)
	l.RequestHitRate = float64(hits) / float64(len(rows))
	l.CachedTokenRatio = float64(cached) / float64(prompt)
	return &l
}

// traceTokens appends the prompt of a trace row: each hash id becomes the
// same per pseudo-random tokens wherever it appears (512 in Mooncake's
// traces), the last id truncated to the input length.
func traceTokens(ids []uint64, per, inputLen int, dst []uint32) []uint32 {
	for i, id := range ids {
		n := min(per, inputLen-i*per)
		dst = blockTokens(id, n, dst)
	}
	return dst
}

// blockTokens appends the first n tokens of hash id's block: a splitmix64
// stream keyed by the id.
func blockTokens(id uint64, n int, dst []uint32) []uint32 {
	// Start each id's stream at a scrambled point so neighbouring ids do not
	// yield shifted copies of one stream.
	s := splitmix.Mix(id ^ 0x6b76726f75746572)
	for range n {
		s += 0x9e3779b97f4a7c15
		dst = append(dst, uint32(splitmix.Mix(s)%Vocab))
	}
	return dst
}
