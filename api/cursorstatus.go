package api

import (
	"net/http"
	"strings"

	"github.com/gin-gonic/gin"
)

// CursorReporter is the optional Replica side of `/cluster/status?view=cursors`:
// the few fields a poller of ingest progress reads (kvbench ingest polls
// every replica every few milliseconds). The full document costs about a
// millisecond of CPU per call — every worker's capacity, the fleet plan, hit
// rates, then a JSON round trip for redaction — which kvbench's polls added
// to the very CPU per block event it measures (BENCHMARKS.md, issue 31
// item 3: 13 % of the Raft leader's CPU in one profile). A Replica without
// it answers the full document, which holds the same fields.
type CursorReporter interface {
	CursorStatus() CursorStatus
}

// CursorStatus is the body of `/cluster/status?view=cursors`: a subset of the
// full document, with the same names, so a reader of the full document can
// read it unchanged.
type CursorStatus struct {
	NodeID       string         `json:"node_id"`
	State        string         `json:"state"`
	LeaderID     string         `json:"leader_id"`
	AppliedIndex uint64         `json:"applied_index"`
	Workers      []CursorWorker `json:"workers"`
}

// CursorWorker is one registered worker's ranks.
type CursorWorker struct {
	ID    string       `json:"id"`
	Ranks []CursorRank `json:"ranks"`
}

// CursorRank is one data-parallel rank: its last applied event id, the
// blocks the index holds for it and, if the state machine marked it stale,
// why.
type CursorRank struct {
	Rank        int    `json:"rank"`
	Blocks      int    `json:"blocks"`
	LastEventID uint64 `json:"last_event_id"`
	Stale       string `json:"stale,omitempty"`
}

// cursorStatus answers `?view=cursors` when the replica can; it reports
// whether it did. Worker ids and the node's names go through redact like
// every string of the full document.
func (s *Server) cursorStatus(c *gin.Context) bool {
	cr, ok := s.rep.(CursorReporter)
	if !ok {
		return false
	}
	st := cr.CursorStatus()
	secrets := s.secrets()
	st.NodeID, st.LeaderID = redactWith(st.NodeID, secrets), redactWith(st.LeaderID, secrets)
	for i := range st.Workers {
		st.Workers[i].ID = redactWith(st.Workers[i].ID, secrets)
		for j := range st.Workers[i].Ranks {
			st.Workers[i].Ranks[j].Stale = redactWith(st.Workers[i].Ranks[j].Stale, secrets)
		}
	}
	if st.Workers == nil {
		st.Workers = []CursorWorker{}
	}
	c.JSON(http.StatusOK, st)
	return true
}

// redactWith is Server.redact with the secrets listed once per document and
// the URL-userinfo regexp run only on strings that can match it (it needs
// an "@"): the same result for a fraction of the cost, which counts at one
// poll per 10 ms.
func redactWith(v string, secrets []string) string {
	if v == "" {
		return v
	}
	if strings.IndexByte(v, '@') >= 0 {
		v = userinfoRE.ReplaceAllString(v, "${1}"+redacted+"@")
	}
	for _, secret := range secrets {
		if strings.Contains(v, secret) {
			v = strings.ReplaceAll(v, secret, redacted)
		}
	}
	return v
}
