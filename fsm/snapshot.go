package fsm

import (
	"bufio"
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"maps"
	"slices"
	"strings"

	"github.com/hashicorp/raft"

	"github.com/kvrouter/kvrouter/router"
)

// Snapshot stream, format versions 1 to 6 (see DESIGN.md):
//
//	"KVRS" | byte format version (1; 2 when a worker has a role; 3 when a
//	  worker's block size differs from the header's, the cluster default;
//	  4 when a rank holds blocks in a lower storage tier; 5 once the data
//	  group count is set: a worker was ever placed, or SetGroups applied;
//	  6 while a worker is drained)
//	records: byte type | uvarint body length (<= maxRecordLen) | body
//	  1 header (exactly once, first): u64 applied index, uvarint block size,
//	    varint clock, uvarint counts of nodes, workers, models, cursors,
//	    block records, prediction records (v4: and tier block records;
//	    v5: then uvarint data groups, uvarint count of placement records;
//	    v6: then uvarint count of drain records — its data groups may be 0)
//	  2 node, 3 worker (v2: role string after the RegisterWorker
//	    payload when the worker has one), 4 model, 5 cursor, 6 blocks,
//	    7 predictions, 8 (v4) tier blocks: a blocks record with a tier
//	    byte (router.Tier 1–3) after the rank, 9 (v5) placement: worker
//	    id, uvarint group, 10 (v6) drain: worker id, varint deadline
//	    (in this type order; within a type sorted by id, then rank, then
//	    tier, then hash)
//	  0 end (empty body)
//	u32 LE CRC-32C (Castagnoli) of every byte before it
//
// Blocks and predictions of one rank are split into records of at most
// snapshotChunk entries, so no record is large and a reader never allocates
// more than maxRecordLen from a length it has not verified.
const (
	snapshotMagic = "KVRS"
	// SnapshotVersion is the newest format this build writes; Restore reads
	// every version up to it. A snapshot is written in the oldest version
	// that expresses its state (snapshotVersionOf), so replicas of older
	// builds can still install it during a rolling upgrade unless the state
	// holds something they cannot represent, which they then refuse by
	// version instead of misreading.
	SnapshotVersion = SnapshotFormatSessionStages

	// SnapshotFormatDrains is the format that adds drained workers
	// (record recDrain and the header's drain count).
	SnapshotFormatDrains = 6
	// SnapshotFormatSessions is the format that adds session bindings
	// (record recSession and the header's session count, after the drain
	// count).
	SnapshotFormatSessions = 7
	// SnapshotFormatPins is the format that adds prefix pins (record
	// recPin and the header's pin count, after the session count).
	SnapshotFormatPins = 8
	// SnapshotFormatSessionStages is the format whose session records end
	// with the binding's prefill stage (two-stage bindings, command 21).
	SnapshotFormatSessionStages = 9

	// digestVersion is the version byte the digest hashes whatever version
	// expresses the state: a state has one digest, and it is the one the
	// builds before format 2 computed (they hashed roles as a trailing field
	// of a version 1 record), so digests compare across a rolling upgrade.
	digestVersion = 1

	recEnd    = 0
	recHeader = 1
	recNode   = 2
	recWorker = 3
	recModel  = 4
	recCursor = 5
	recBlocks = 6
	recPreds  = 7
	// recTierBlocks: format 4, blocks of the lower storage tiers.
	recTierBlocks = 8
	// recPlacement: format 5, one worker's data group.
	recPlacement = 9
	// recDrain: format 6, a drained worker (after every worker record).
	recDrain = 10
	// recSession: format 7, one session binding.
	recSession = 11
	// recPin: format 8, one prefix pin.
	recPin     = 12
	recMaxType = recPin

	snapshotChunk = 16384
	maxRecordLen  = 1 << 20

	cursorResynced = 1 << 0
	cursorStale    = 1 << 1
)

// ErrCorruptSnapshot marks a snapshot Restore refused (bad magic, version,
// CRC, record, or a state that breaks an invariant). The FSM is unchanged.
var ErrCorruptSnapshot = errors.New("corrupt snapshot")

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// image is a consistent copy of the state, taken under the lock and written
// without it. Everything in it is sorted: the bytes depend only on the state.
// The blocks, by far its largest part, are copied under the lock unsorted
// (pending) and sorted by resolve, which writeImage calls: Raft's apply
// loop waits while FSM.Snapshot runs, and sorting ten million blocks there
// stalled ingest for 5-7 s; Persist runs beside the applies.
type image struct {
	pending   *pendingBlocks
	applied   uint64
	blockSize int
	lastTick  int64
	nodes     []NodeRecord
	workers   []WorkerRecord
	models    []SetModelConfig
	cursors   []cursorImage
	blocks    []rankBlocks
	preds     []rankPreds
	tiers     []rankBlocks // lower tiers' blocks, tier set

	groups     uint32 // data groups of the placements; 0 = never set
	placements []placementImage
	drains     []WorkerDrain    // sorted by worker
	sessions   []SessionBinding // sorted by session id
	pins       []Pin            // sorted by model, worker, key
}

// placementImage is one worker's placement, sorted by worker.
type placementImage struct {
	worker string
	group  uint32
}

// pendingBlocks is an image's blocks as copied under the lock: the index's
// copy per tier and, in image order, the ranks whose blocks to take.
type pendingBlocks struct {
	copies [router.NumTiers]*router.BlocksCopy // nil: the tier is empty
	ranks  []rankRef
}

type rankRef struct {
	key    router.WorkerID
	worker string
	rank   uint32
}

// resolve sorts the pending blocks into blocks and tiers (idempotent).
func (img *image) resolve() {
	p := img.pending
	if p == nil {
		return
	}
	img.pending = nil
	var res [router.NumTiers]map[router.WorkerID]router.ResolvedBlocks
	for t, c := range p.copies {
		if c != nil {
			res[t] = c.Resolve()
		}
	}
	for _, r := range p.ranks {
		if b := res[router.TierDevice][r.key]; len(b.Blocks) > 0 {
			img.blocks = append(img.blocks, rankBlocks{worker: r.worker, rank: r.rank, blocks: b.Blocks, dangling: b.Dangling})
		}
		for t := router.TierHost; t < router.NumTiers; t++ {
			if b := res[t][r.key]; len(b.Blocks) > 0 {
				img.tiers = append(img.tiers, rankBlocks{worker: r.worker, rank: r.rank, tier: t, blocks: b.Blocks, dangling: b.Dangling})
			}
		}
	}
}

type cursorImage struct {
	worker   string
	rank     uint32
	last     uint64
	resynced bool
	stale    bool
	reason   string
	staleID  uint64
}

type rankBlocks struct {
	worker   string
	rank     uint32
	tier     router.Tier          // recTierBlocks only
	blocks   []router.StoredBlock // sorted by content, then engine hash (Index.WorkerBlocks)
	dangling []bool               // nil, or per block: an engine alias whose content is not held
}

// Block entry flags in a blocks record.
const (
	blockPlain    = 0 // held, engine hash = content hash
	blockAlias    = 1 // held under an engine hash that differs (u64 engine hash follows)
	blockDangling = 2 // an engine alias whose content the rank no longer holds (u64 follows)
)

type predHash struct {
	hash  uint64
	until int64
}

type rankPreds struct {
	worker  string
	rank    uint32
	entries []predHash // sorted by hash
}

// captureLocked copies the state. f.mu must be held (read is enough); the
// indexes are read through their own locks, and no apply runs meanwhile.
func (f *FSM) captureLocked() *image {
	st := f.st
	img := &image{applied: f.applied.Load(), blockSize: st.blockSize, lastTick: st.lastTick, groups: st.groups}
	for w, g := range st.placements {
		img.placements = append(img.placements, placementImage{worker: w, group: g})
	}
	slices.SortFunc(img.placements, func(a, b placementImage) int { return strings.Compare(a.worker, b.worker) })
	img.captureSessions(st)
	img.capturePins(st)
	for _, n := range st.nodes {
		img.nodes = append(img.nodes, n)
	}
	slices.SortFunc(img.nodes, func(a, b NodeRecord) int { return strings.Compare(a.ID, b.ID) })
	for _, o := range st.models {
		img.models = append(img.models, o.clone())
	}
	slices.SortFunc(img.models, func(a, b SetModelConfig) int { return strings.Compare(a.Model, b.Model) })
	ids := make([]string, 0, len(st.workers))
	for id := range st.workers {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	// The blocks are copied, not sorted, here (image.resolve). An engine
	// alias whose content the rank no longer holds (router.Index keeps it
	// when a block is removed under another name; it still satisfies
	// parent checks) is state too: Resolve flags it dangling.
	pend := &pendingBlocks{}
	pend.copies[router.TierDevice] = st.index.CopyWorkerBlocks()
	for t := router.TierHost; t < router.NumTiers; t++ {
		if l := st.index.LowerTier(t); l != nil && l.Len() > 0 {
			pend.copies[t] = l.CopyWorkerBlocks()
		}
	}
	img.pending = pend
	for _, id := range ids {
		ws := st.workers[id]
		img.workers = append(img.workers, ws.rec)
		if ws.drain != nil {
			img.drains = append(img.drains, WorkerDrain{Worker: id, Deadline: ws.drain.deadline})
		}
		for _, rs := range ws.ranks {
			img.cursors = append(img.cursors, cursorImage{worker: rs.worker, rank: rs.rank, last: rs.last,
				resynced: rs.resynced, stale: rs.stale, reason: rs.reason, staleID: rs.staleID})
			pend.ranks = append(pend.ranks, rankRef{key: rs.key, worker: rs.worker, rank: rs.rank})
			if m := st.preds[rs.key]; len(m) > 0 {
				e := make([]predHash, 0, len(m))
				for h, u := range m {
					e = append(e, predHash{hash: h, until: u})
				}
				slices.SortFunc(e, func(a, b predHash) int { return cmp.Compare(a.hash, b.hash) })
				img.preds = append(img.preds, rankPreds{worker: rs.worker, rank: rs.rank, entries: e})
			}
		}
	}
	return img
}

func chunks(n int) int { return (n + snapshotChunk - 1) / snapshotChunk }

// crcWriter computes the CRC of what passes through it.
type crcWriter struct {
	w   io.Writer
	crc uint32
	err error
	buf []byte
}

func (c *crcWriter) write(p []byte) {
	if c.err != nil {
		return
	}
	c.crc = crc32.Update(c.crc, castagnoli, p)
	_, c.err = c.w.Write(p)
}

// record writes one typed record whose body is c.buf.
func (c *crcWriter) record(typ byte) {
	var hdr [1 + binary.MaxVarintLen64]byte
	hdr[0] = typ
	n := binary.PutUvarint(hdr[1:], uint64(len(c.buf)))
	c.write(hdr[:1+n])
	c.write(c.buf)
}

// snapshotVersionOf is the oldest format that expresses img: 7 while a
// session is bound (older readers know no session record), 6 while a
// worker is drained (older readers know no drain record), 5 once the
// group count is set, by a placement or SetGroups (it outlives the
// placements, and may come with none; older
// readers would refuse the record type or the header's extra counts), 4
// once a rank holds blocks in a lower tier (older readers would refuse the
// record type rather than drop the blocks), 3 once a
// worker's block size differs from the cluster default (formats 1 and 2
// hold the same bytes but their readers refuse such a worker), else 2 once
// a worker has a role (format 1 has no field for it), else 1.
func snapshotVersionOf(img *image) byte {
	for _, b := range img.sessions {
		if b.Prefill != "" {
			return SnapshotFormatSessionStages
		}
	}
	if len(img.pins) > 0 {
		return SnapshotFormatPins
	}
	if len(img.sessions) > 0 {
		return SnapshotFormatSessions
	}
	if len(img.drains) > 0 {
		return SnapshotFormatDrains
	}
	if img.groups != 0 || len(img.placements) > 0 {
		return 5
	}
	if len(img.tiers) > 0 {
		return 4
	}
	v := byte(1)
	for _, w := range img.workers {
		if w.BlockSize != img.blockSize {
			return 3
		}
		if w.Role != "" {
			v = 2
		}
	}
	return v
}

// writeImage streams img in the snapshot format. withApplied false is the
// digest's canonical form: 0 for the applied index and digestVersion for
// the version byte.
func writeImage(w io.Writer, img *image, withApplied bool) error {
	img.resolve()
	c := &crcWriter{w: w, buf: make([]byte, 0, 4096)}
	c.write([]byte(snapshotMagic))
	// The header's optional fields follow the state's version, not the
	// version byte (which the digest fixes at 1): a state keeps the bytes,
	// and so the digest, it had before the fields existed.
	stateVersion := snapshotVersionOf(img)
	version := stateVersion
	if !withApplied {
		version = digestVersion
	}
	c.write([]byte{version})

	nBlocks, nPreds, nTiers := 0, 0, 0
	for _, rb := range img.blocks {
		nBlocks += chunks(len(rb.blocks))
	}
	for _, rb := range img.tiers {
		nTiers += chunks(len(rb.blocks))
	}
	for _, rp := range img.preds {
		nPreds += chunks(len(rp.entries))
	}
	applied := img.applied
	if !withApplied {
		applied = 0
	}
	b := appendU64(c.buf[:0], applied)
	b = binary.AppendUvarint(b, uint64(img.blockSize))
	b = binary.AppendVarint(b, img.lastTick)
	for _, n := range []int{len(img.nodes), len(img.workers), len(img.models), len(img.cursors), nBlocks, nPreds} {
		b = binary.AppendUvarint(b, uint64(n))
	}
	if stateVersion >= 4 {
		b = binary.AppendUvarint(b, uint64(nTiers)) // 0 in a format-5 state without tiers
	}
	if stateVersion >= 5 {
		b = binary.AppendUvarint(b, uint64(img.groups)) // 0 in a format-7 state never placed
		b = binary.AppendUvarint(b, uint64(len(img.placements)))
	}
	if stateVersion >= SnapshotFormatDrains {
		b = binary.AppendUvarint(b, uint64(len(img.drains)))
	}
	if stateVersion >= SnapshotFormatSessions {
		b = binary.AppendUvarint(b, uint64(len(img.sessions))) // 0 in a format-8 state without bindings
	}
	if stateVersion >= SnapshotFormatPins {
		b = binary.AppendUvarint(b, uint64(len(img.pins)))
	}
	c.buf = b
	c.record(recHeader)

	for _, n := range img.nodes {
		b = appendString(c.buf[:0], n.ID)
		b = appendString(b, n.RaftAddr)
		c.buf = appendString(b, n.HTTPAddr)
		c.record(recNode)
	}
	for _, w := range img.workers {
		rw := w.command()
		b, err := appendRegisterWorker(c.buf[:0], &rw)
		if err == nil && rw.Role != "" {
			// Present only with a role (then the format is 2): a record
			// without it is a worker registered without a role.
			b, err = appendRole(b, &rw)
		}
		if err != nil {
			return fmt.Errorf("snapshot worker %q: %w", w.ID, err)
		}
		c.buf = b
		c.record(recWorker)
	}
	for i := range img.models {
		m := &img.models[i]
		c.buf = appendModelValues(appendString(c.buf[:0], m.Model), m)
		c.record(recModel)
	}
	for _, cu := range img.cursors {
		b = appendString(c.buf[:0], cu.worker)
		b = binary.AppendUvarint(b, uint64(cu.rank))
		b = binary.AppendUvarint(b, cu.last)
		flags := byte(0)
		if cu.resynced {
			flags |= cursorResynced
		}
		if cu.stale {
			flags |= cursorStale
		}
		b = append(b, flags)
		if cu.stale {
			b = appendString(b, cu.reason)
			b = binary.AppendUvarint(b, cu.staleID)
		}
		c.buf = b
		c.record(recCursor)
	}
	writeBlocks := func(rb rankBlocks, typ byte) {
		for start := 0; start < len(rb.blocks); start += snapshotChunk {
			part := rb.blocks[start:min(start+snapshotChunk, len(rb.blocks))]
			b := appendString(c.buf[:0], rb.worker)
			b = binary.AppendUvarint(b, uint64(rb.rank))
			if typ == recTierBlocks {
				b = append(b, byte(rb.tier))
			}
			b = binary.AppendUvarint(b, uint64(len(part)))
			for i, sb := range part {
				b = appendU64(b, sb.ContentHash)
				switch {
				case sb.EngineHash == sb.ContentHash:
					b = append(b, blockPlain)
				case rb.dangling != nil && rb.dangling[start+i]:
					b = appendU64(append(b, blockDangling), sb.EngineHash)
				default:
					b = appendU64(append(b, blockAlias), sb.EngineHash)
				}
			}
			c.buf = b
			c.record(typ)
		}
	}
	for _, rb := range img.blocks {
		writeBlocks(rb, recBlocks)
	}
	for _, rp := range img.preds {
		for part := range slices.Chunk(rp.entries, snapshotChunk) {
			b = appendString(c.buf[:0], rp.worker)
			b = binary.AppendUvarint(b, uint64(rp.rank))
			b = binary.AppendUvarint(b, uint64(len(part)))
			for _, e := range part {
				b = binary.AppendVarint(appendU64(b, e.hash), e.until)
			}
			c.buf = b
			c.record(recPreds)
		}
	}
	for _, rb := range img.tiers {
		writeBlocks(rb, recTierBlocks)
	}
	for _, p := range img.placements {
		c.buf = binary.AppendUvarint(appendString(c.buf[:0], p.worker), uint64(p.group))
		c.record(recPlacement)
	}
	for _, d := range img.drains {
		c.buf = binary.AppendVarint(appendString(c.buf[:0], d.Worker), d.Deadline)
		c.record(recDrain)
	}
	for i := range img.sessions {
		c.buf = appendSessionRecord(c.buf[:0], &img.sessions[i], stateVersion >= SnapshotFormatSessionStages)
		c.record(recSession)
	}
	for i := range img.pins {
		c.buf = appendPinRecord(c.buf[:0], &img.pins[i])
		c.record(recPin)
	}
	c.buf = c.buf[:0]
	c.record(recEnd)
	if c.err != nil {
		return c.err
	}
	var trailer [4]byte
	binary.LittleEndian.PutUint32(trailer[:], c.crc)
	_, err := w.Write(trailer[:])
	return err
}

// fsmSnapshot is a captured image waiting to be persisted.
type fsmSnapshot struct{ img *image }

// Snapshot captures the state under the read lock (raft calls it between
// applies); Persist writes it while applies continue.
//
// A halted FSM refuses: raft would label the snapshot with its own last
// applied index, past the entry this build could not apply, and compact the
// log up to it, so a restarted newer build would restore a state that
// misses those entries and never replay them. Refusing keeps the log.
func (f *FSM) Snapshot() (raft.FSMSnapshot, error) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if h := f.halt.Load(); h != nil {
		return nil, fmt.Errorf("snapshot: %w", h)
	}
	return &fsmSnapshot{img: f.captureLocked()}, nil
}

// Persist streams the snapshot to sink and closes it, or cancels it on error.
func (s *fsmSnapshot) Persist(sink raft.SnapshotSink) error {
	bw := bufio.NewWriterSize(sink, 256<<10)
	err := writeImage(bw, s.img, true)
	if err == nil {
		err = bw.Flush()
	}
	if err != nil {
		_ = sink.Cancel()
		return fmt.Errorf("persist snapshot: %w", err)
	}
	return sink.Close()
}

// Release drops the image.
func (s *fsmSnapshot) Release() { s.img = nil }

// Digest is the hex SHA-256 of the state's canonical serialization (the
// snapshot format with the applied index left out): replicas that applied
// the same commands have equal digests whenever and however they got there,
// and equal digests mean equal state. Cached until the next apply.
func (f *FSM) Digest() string {
	f.mu.RLock()
	key := [2]uint64{f.applied.Load(), f.gen.Load()}
	f.digestMu.Lock()
	if f.digestValue != "" && f.digestKey == key {
		d := f.digestValue
		f.digestMu.Unlock()
		f.mu.RUnlock()
		return d
	}
	f.digestMu.Unlock()
	img := f.captureLocked()
	f.mu.RUnlock()

	h := sha256.New()
	_ = writeImage(h, img, false) // hashes never fail to write
	d := hex.EncodeToString(h.Sum(nil))
	f.digestMu.Lock()
	f.digestKey, f.digestValue = key, d
	f.digestMu.Unlock()
	return d
}

// Restore replaces the state with a snapshot. It reads the stream into a
// fresh state, checks magic, version, every record, the invariants and the
// CRC, and only then swaps it in; on any error the FSM is unchanged.
func (f *FSM) Restore(rc io.ReadCloser) error {
	defer rc.Close()
	newest := f.newestFormat
	if newest == 0 {
		newest = SnapshotVersion
	}
	st, applied, err := readSnapshot(rc, f.base, newest)
	if err != nil {
		return fmt.Errorf("restore: %w", err)
	}
	f.mu.Lock()
	f.st = st
	f.applied.Store(applied)
	// The snapshot holds a state this build can represent (it read it), so
	// whatever the FSM halted on is in it or after it: apply again.
	f.halt.Store(nil)
	f.gen.Add(1)
	f.index.Store(st.index)
	f.predicted.Store(st.predicted)
	maps.DeleteFunc(f.refused, func(id string, _ uint64) bool { return st.workers[id] == nil })
	f.mu.Unlock()
	f.notify([]Change{{Kind: ChangeRestored, Index: applied}})
	return nil
}

// snapReader reads a snapshot stream and keeps the CRC of what it read.
type snapReader struct {
	br  *bufio.Reader
	crc uint32
	buf []byte
}

func (s *snapReader) ReadByte() (byte, error) {
	c, err := s.br.ReadByte()
	if err != nil {
		return 0, err
	}
	s.crc = crc32.Update(s.crc, castagnoli, []byte{c})
	return c, nil
}

func (s *snapReader) readFull(p []byte) error {
	if _, err := io.ReadFull(s.br, p); err != nil {
		return err
	}
	s.crc = crc32.Update(s.crc, castagnoli, p)
	return nil
}

// next reads one record: its type and body (valid until the next call).
func (s *snapReader) next() (byte, []byte, error) {
	typ, err := s.ReadByte()
	if err != nil {
		return 0, nil, err
	}
	n, err := binary.ReadUvarint(s)
	if err != nil {
		return 0, nil, err
	}
	if n > maxRecordLen {
		return 0, nil, fmt.Errorf("record type %d length %d over %d", typ, n, maxRecordLen)
	}
	if uint64(cap(s.buf)) < n {
		s.buf = make([]byte, n)
	}
	s.buf = s.buf[:n]
	return typ, s.buf, s.readFull(s.buf)
}

func corrupt(format string, args ...any) error {
	return fmt.Errorf("%s: %w", fmt.Sprintf(format, args...), ErrCorruptSnapshot)
}

// readSnapshot builds a fresh state from a snapshot stream of a format
// version up to newest.
func readSnapshot(r io.Reader, base router.Config, newest byte) (*state, uint64, error) {
	s := &snapReader{br: bufio.NewReaderSize(r, 256<<10)}
	var magic [len(snapshotMagic) + 1]byte
	if err := s.readFull(magic[:]); err != nil {
		return nil, 0, corrupt("read magic: %v", err)
	}
	if string(magic[:4]) != snapshotMagic {
		return nil, 0, corrupt("bad magic %q", magic[:4])
	}
	version := magic[4]
	if version < 1 || version > newest {
		return nil, 0, corrupt("format version %d, this build reads 1 to %d", version, newest)
	}
	st := newState(base.BlockSize)
	var applied uint64
	type danglingAlias struct {
		rs   *rankState
		tier router.Tier
		b    router.StoredBlock
	}
	var dangling []danglingAlias
	var want, got [recMaxType + 1]int
	lastType := byte(0)
	for {
		typ, body, err := s.next()
		if err != nil {
			return nil, 0, corrupt("read record after type %d: %v", lastType, err)
		}
		if typ == recEnd {
			if len(body) != 0 {
				return nil, 0, corrupt("end record with a body")
			}
			break
		}
		if typ > recMaxType || typ < lastType || (typ == recHeader) != (lastType == 0) || (typ == recTierBlocks && version < 4) ||
			(typ == recPlacement && version < 5) || (typ == recDrain && version < SnapshotFormatDrains) ||
			(typ == recSession && version < SnapshotFormatSessions) || (typ == recPin && version < SnapshotFormatPins) {
			return nil, 0, corrupt("record type %d after %d", typ, lastType)
		}
		lastType = typ
		got[typ]++
		rd := &reader{b: body}
		switch typ {
		case recHeader:
			if got[recHeader] > 1 {
				return nil, 0, corrupt("second header")
			}
			applied = rd.u64()
			if bs := rd.int("block size"); rd.err == nil && bs != base.BlockSize {
				return nil, 0, corrupt("block size %d, this index uses %d", bs, base.BlockSize)
			}
			st.lastTick = rd.varint()
			want[recHeader] = 1
			for t := recNode; t <= recPreds; t++ {
				want[t] = rd.int("count")
			}
			if version >= 4 {
				want[recTierBlocks] = rd.int("count")
			}
			if version >= 5 {
				// Format 5 is written only once the group count is
				// set (a placement or SetGroups), and both need at
				// least 2 groups. Formats 6 and 7 are written for
				// drains and sessions too, in a state whose count may
				// never have been set (0: never).
				if st.groups = rd.u32("groups"); rd.err == nil && st.groups < 2 && (version < SnapshotFormatDrains || st.groups != 0) {
					return nil, 0, corrupt("format %d with %d data groups", version, st.groups)
				}
				want[recPlacement] = rd.int("count")
			}
			if version >= SnapshotFormatDrains {
				want[recDrain] = rd.int("count")
			}
			if version >= SnapshotFormatSessions {
				want[recSession] = rd.int("count")
			}
			if version >= SnapshotFormatPins {
				want[recPin] = rd.int("count")
			}
		case recNode:
			n := NodeRecord{ID: rd.string("node id"), RaftAddr: rd.string("raft addr"), HTTPAddr: rd.string("http addr")}
			if _, dup := st.nodes[n.ID]; rd.err == nil && (dup || n.ID == "") {
				return nil, 0, corrupt("node %q empty or repeated", n.ID)
			}
			st.nodes[n.ID] = n
		case recWorker:
			c := readRegisterWorker(rd)
			// Version 2 carries a role after the payload when the worker has
			// one. Version 1 has no role field, but the builds that added
			// roles before format 2 wrote it there all the same
			// (testdata/snapshot-v1-roles.bin): read it in both, so their
			// snapshots restore after an upgrade.
			if rd.err == nil && len(rd.b) > 0 {
				c.Role = readRole(rd)
			}
			if rd.err == nil {
				if err := c.Validate(); err != nil {
					return nil, 0, corrupt("worker: %v", err)
				}
				// Before format 3 every worker has the cluster default block
				// size (those builds refuse any other); from 3 on, a model's
				// workers share one.
				if c.BlockSize <= 0 || (version < 3 && c.BlockSize != base.BlockSize) || st.workers[c.ID] != nil {
					return nil, 0, corrupt("worker %q block size %d or repeated", c.ID, c.BlockSize)
				}
				if ms, ok := st.modelSizes[c.Model]; ok && ms.blockSize != c.BlockSize {
					return nil, 0, corrupt("worker %q block size %d, another worker of model %q has %d", c.ID, c.BlockSize, c.Model, ms.blockSize)
				}
				ws := &workerState{rec: c.record()}
				for r := range c.DPRanks {
					ws.ranks = append(ws.ranks, st.addRank(c.ID, r, c.BlockSize))
				}
				st.workers[c.ID] = ws
				st.countWorker(ws.rec, 1)
			}
		case recModel:
			m := &SetModelConfig{Model: rd.string("model")}
			readModelValues(rd, m)
			if rd.err == nil {
				if m.Model == "" || st.models[m.Model] != nil {
					return nil, 0, corrupt("model %q empty or repeated", m.Model)
				}
				if err := overlay(base, m).Validate(); err != nil {
					return nil, 0, corrupt("model %q: %v", m.Model, err)
				}
				st.models[m.Model] = m
			}
		case recCursor:
			rs := snapRank(st, rd)
			last := rd.uvarint()
			flags := rd.byte()
			var reason string
			var staleID uint64
			if flags&cursorStale != 0 {
				reason, staleID = rd.string("stale reason"), rd.uvarint()
			}
			if rd.err == nil {
				if rs == nil || flags&^(cursorResynced|cursorStale) != 0 || rs.restored {
					return nil, 0, corrupt("cursor of unknown or repeated rank, or flags %#x", flags)
				}
				rs.restored = true
				rs.last, rs.resynced, rs.stale, rs.reason, rs.staleID = last, flags&cursorResynced != 0, flags&cursorStale != 0, reason, staleID
			}
		case recBlocks, recTierBlocks:
			rs := snapRank(st, rd)
			tier := router.TierDevice
			if typ == recTierBlocks {
				if tier = router.Tier(rd.byte()); rd.err == nil && (tier == router.TierDevice || !tier.Valid()) {
					rd.fail("tier %d", tier)
				}
			}
			n := rd.count("blocks", 9)
			blocks := make([]router.StoredBlock, 0, n)
			for range n {
				ch := rd.u64()
				eh := ch
				flag := rd.byte()
				switch flag {
				case blockPlain:
				case blockAlias, blockDangling:
					if eh = rd.u64(); eh == ch {
						rd.fail("alias to itself")
					}
				default:
					rd.fail("bad block flag %d", flag)
				}
				if flag == blockDangling {
					dangling = append(dangling, danglingAlias{rs, tier, router.StoredBlock{EngineHash: eh, ContentHash: ch}})
				} else {
					blocks = append(blocks, router.StoredBlock{EngineHash: eh, ContentHash: ch})
				}
			}
			if rd.err == nil {
				if rs == nil {
					return nil, 0, corrupt("blocks of an unknown rank")
				}
				if err := st.index.Apply(rs.key, router.KVEvent{Kind: router.EventStored, Blocks: blocks, Tier: tier}); err != nil {
					return nil, 0, corrupt("blocks of %s: %v", rs.key, err)
				}
			}
		case recPlacement:
			p := PlaceWorker{Worker: rd.string("worker id"), Group: rd.u32("group"), Groups: st.groups}
			if rd.err == nil {
				if err := p.Validate(); err != nil {
					return nil, 0, corrupt("placement: %v", err)
				}
				if _, dup := st.placements[p.Worker]; dup {
					return nil, 0, corrupt("placement of %q repeated", p.Worker)
				}
				st.placements[p.Worker] = p.Group
			}
		case recDrain:
			w, deadline := rd.string("worker id"), rd.varint()
			if rd.err == nil {
				ws := st.workers[w]
				if ws == nil || ws.drain != nil || deadline < 0 {
					return nil, 0, corrupt("drain of worker %q unregistered or repeated, or deadline %d", w, deadline)
				}
				ws.drain = &drainState{deadline: deadline}
			}
		case recSession:
			if err := readSessionRecord(st, rd, version >= SnapshotFormatSessionStages); err != nil {
				return nil, 0, err
			}
		case recPin:
			if err := readPinRecord(st, rd); err != nil {
				return nil, 0, err
			}
		case recPreds:
			rs := snapRank(st, rd)
			n := rd.count("predictions", 9)
			entries := make([]predHash, 0, n)
			for range n {
				entries = append(entries, predHash{hash: rd.u64(), until: rd.varint()})
			}
			if rd.err == nil {
				if rs == nil {
					return nil, 0, corrupt("predictions of an unknown rank")
				}
				m := st.preds[rs.key]
				if m == nil {
					m = make(map[uint64]int64, n)
					st.preds[rs.key] = m
				}
				fresh := make([]router.StoredBlock, 0, n)
				for _, e := range entries {
					if _, dup := m[e.hash]; dup || e.until <= st.lastTick {
						return nil, 0, corrupt("prediction %d of %s repeated or expired", e.hash, rs.key)
					}
					m[e.hash] = e.until
					fresh = append(fresh, router.StoredBlock{EngineHash: e.hash, ContentHash: e.hash})
				}
				st.live += n
				if err := st.predicted.Apply(rs.key, router.KVEvent{Kind: router.EventStored, Blocks: fresh}); err != nil {
					return nil, 0, corrupt("predictions of %s: %v", rs.key, err)
				}
			}
		}
		if err := rd.done(); err != nil {
			return nil, 0, corrupt("record type %d: %v", typ, err)
		}
	}
	sum := s.crc
	var trailer [4]byte
	if _, err := io.ReadFull(s.br, trailer[:]); err != nil {
		return nil, 0, corrupt("read crc: %v", err)
	}
	if got := binary.LittleEndian.Uint32(trailer[:]); got != sum {
		return nil, 0, corrupt("crc %08x, computed %08x", got, sum)
	}
	if _, err := s.br.ReadByte(); err != io.EOF {
		return nil, 0, corrupt("bytes after the crc")
	}
	if got[recHeader] != 1 || got != want {
		return nil, 0, corrupt("record counts %v, header says %v", got, want)
	}
	for _, rs := range st.ranks {
		if !rs.restored {
			return nil, 0, corrupt("rank %s has no cursor", rs.key)
		}
		rs.restored = false
	}
	// Recreate dangling aliases the way they arise: stored under the
	// engine name, then removed under the content name (the alias stays).
	var dst []router.Overlap
	for _, d := range dangling {
		held := st.index.TierHeld(d.rs.key, d.tier)
		for _, ev := range []router.KVEvent{
			{Kind: router.EventStored, Blocks: []router.StoredBlock{d.b}, Tier: d.tier},
			{Kind: router.EventRemoved, Removed: []uint64{d.b.ContentHash}, Tier: d.tier},
		} {
			if err := st.index.Apply(d.rs.key, ev); err != nil {
				return nil, 0, corrupt("alias of %s: %v", d.rs.key, err)
			}
		}
		// The content must be neither held before (then it was no dangling
		// alias) nor after (the removal hit another alias named by this
		// content hash: a state this format cannot express; astronomically
		// unlikely with real engine hashes, and refused rather than guessed).
		ix := st.index
		if d.tier != router.TierDevice {
			ix = st.index.LowerTier(d.tier)
		}
		dst = ix.FindMatches([]uint64{d.b.ContentHash}, dst)
		if ix.Held(d.rs.key) != held || slices.ContainsFunc(dst, func(o router.Overlap) bool { return o.Worker == d.rs.key }) {
			return nil, 0, corrupt("dangling alias %d→%d of %s does not restore", d.b.EngineHash, d.b.ContentHash, d.rs.key)
		}
	}
	st.rebuildHeap()
	st.rebuildSessionHeap()
	return st, applied, nil
}

// snapRank reads a (worker, rank) reference and returns the rank, or nil.
func snapRank(st *state, rd *reader) *rankState {
	w := rd.bytes("worker id")
	r := rd.u32("dp rank")
	if rd.err != nil {
		return nil
	}
	return st.rank(string(w), r)
}

func readRegisterWorker(r *reader) RegisterWorker {
	return RegisterWorker{
		ID:               r.string("worker id"),
		DPRanks:          r.u32("dp ranks"),
		Address:          r.string("address"),
		Model:            r.string("model"),
		BlockSize:        r.int("block size"),
		TotalBlocks:      r.int("total blocks"),
		MaxBatchedTokens: r.int("max batched tokens"),
		LeaseUntil:       r.varint(),
	}
}
