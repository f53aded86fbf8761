package live

import (
	"bufio"
	"context"
	"net/http"
	"strconv"
	"strings"
)

// Expectation is what one synthetic worker's acknowledged events must have
// left on every replica: its cursor at LastAcked or beyond, and exactly
// Blocks blocks held (every block content is unique, so the stored blocks
// of the acknowledged events minus the removed ones).
type Expectation struct {
	Worker      string
	LastAcked   uint64 // highest acknowledged event id (acks are in id order)
	AckedEvents uint64
	Blocks      int  // blocks the worker must hold
	Unsure      bool // some of its events failed: their outcome is unknown, extra blocks are no loss
}

// Shortfall is one worker on one replica missing acknowledged events.
type Shortfall struct {
	Replica       string `json:"replica"`
	Worker        string `json:"worker"`
	Cursor        uint64 `json:"last_event_id"`
	LastAcked     uint64 `json:"last_acked"`
	Blocks        int    `json:"blocks"`
	Expected      int    `json:"expected_blocks"`
	MissingEvents uint64 `json:"missing_events"`
	Stale         string `json:"stale,omitempty"`
	Unregistered  bool   `json:"unregistered,omitempty"`
	Unreachable   bool   `json:"unreachable,omitempty"`
}

// LostCount is the verdict of CountLost.
type LostCount struct {
	// Events: acknowledged events missing from at least one replica. Per
	// worker the most any replica misses (missing events are the ones past
	// a replica's cursor, so they nest), summed over workers.
	Events uint64
	// Blocks: blocks missing (fewer held than expected), same rule.
	Blocks int
	// ExtraBlocks: blocks held beyond the expected ones (a removal not
	// applied, or an unacknowledged event that made it), same rule.
	ExtraBlocks int
	Detail      []Shortfall
}

// CountLost compares every replica's final status (nil: unreachable, which
// counts everything as missing: it cannot be verified) with what was
// acknowledged. A replica misses a worker's acknowledged events when its
// cursor is short of the last acknowledged id (that many events), or when
// it holds a different number of blocks than expected although its cursor
// is there (an event consumed but not applied): fewer blocks count
// ⌈missing ÷ blocks per event⌉ events, more blocks (a removal that was not
// applied) one event, unless the worker is Unsure.
func CountLost(exp []Expectation, blocksPerEvent int, names []string, finals []*Status) LostCount {
	var out LostCount
	bpe := max(blocksPerEvent, 1)
	for _, e := range exp {
		var worstEv uint64
		var worstMiss, worstExtra int
		for r, st := range finals {
			sf := Shortfall{Replica: names[r], Worker: e.Worker, LastAcked: e.LastAcked, Expected: e.Blocks}
			miss, extra := 0, 0
			switch w, ok := workerOf(st, e.Worker); {
			case st == nil:
				sf.Unreachable = true
				sf.MissingEvents, miss = e.AckedEvents, e.Blocks
			case !ok || len(w.Ranks) == 0:
				sf.Unregistered = true
				sf.MissingEvents, miss = e.AckedEvents, e.Blocks
			default:
				rk := w.Ranks[0]
				sf.Cursor, sf.Blocks, sf.Stale = rk.LastEventID, rk.Blocks, rk.Stale
				if rk.LastEventID < e.LastAcked {
					sf.MissingEvents = e.LastAcked - rk.LastEventID
				}
				switch d := e.Blocks - rk.Blocks; {
				case d > 0:
					miss = d
					sf.MissingEvents = max(sf.MissingEvents, uint64((d+bpe-1)/bpe))
				case d < 0:
					extra = -d
					if !e.Unsure {
						sf.MissingEvents = max(sf.MissingEvents, 1)
					}
				}
				sf.MissingEvents = min(sf.MissingEvents, e.AckedEvents)
			}
			if sf.MissingEvents > 0 || miss > 0 || extra > 0 {
				out.Detail = append(out.Detail, sf)
			}
			worstEv = max(worstEv, sf.MissingEvents)
			worstMiss = max(worstMiss, miss)
			worstExtra = max(worstExtra, extra)
		}
		out.Events += worstEv
		out.Blocks += worstMiss
		out.ExtraBlocks += worstExtra
	}
	return out
}

func workerOf(st *Status, id string) (Worker, bool) {
	if st == nil {
		return Worker{}, false
	}
	return st.Worker(id)
}

// Metrics scrapes base's /metrics and returns the values of the named
// unlabelled series (histograms: name_sum, name_count).
func (c *Client) Metrics(ctx context.Context, base string, names ...string) (map[string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, BaseURL(base)+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, &HTTPError{URL: req.URL.String(), Status: resp.StatusCode}
	}
	return parseMetrics(bufio.NewScanner(resp.Body), names), nil
}

func parseMetrics(sc *bufio.Scanner, names []string) map[string]float64 {
	want := map[string]bool{}
	for _, n := range names {
		want[n] = true
	}
	out := map[string]float64{}
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		name, val, ok := strings.Cut(line, " ")
		if !ok || !want[name] {
			continue
		}
		if v, err := strconv.ParseFloat(strings.TrimSpace(val), 64); err == nil {
			out[name] = v
		}
	}
	return out
}
